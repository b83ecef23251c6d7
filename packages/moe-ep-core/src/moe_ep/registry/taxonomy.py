"""Kernel names as a taxonomy: `<arch>_<act>_<weight>_<out>_<style>`.

`arch` is `any` or `smNN` (e.g. `sm90`, `sm100`); `act`, `weight`, `out` are dtype tags;
`style` is one or more lowercase words joined by `_` (e.g. `torch`, `pull_cutedsl`).
The config class of a kernel is `<Arch>_<Act>_<Weight>_<Out>_<Style>_MegaMoeConfig`, each
part capitalized and the style's words joined: `sm90_fp8_fp8_bf16_pull_cutedsl` ->
`Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moe_ep.errors import MoeEpUsageError

__all__ = ["DTYPE_TAGS", "KernelName", "parse_kernel_name"]

DTYPE_TAGS: frozenset[str] = frozenset(
    {"bf16", "fp16", "fp32", "fp8", "mxfp8", "fp4", "nvfp4", "mxfp4", "int8"}
)
_ARCH = re.compile(r"^(any|sm[0-9]{2,3}[a-z]?)$")
_STYLE = re.compile(r"^[a-z][a-z0-9]*(_[a-z][a-z0-9]*)*$")


@dataclass(frozen=True)
class KernelName:
    """A parsed kernel name."""

    arch: str
    act: str
    weight: str
    out: str
    style: str

    def __str__(self) -> str:
        return f"{self.arch}_{self.act}_{self.weight}_{self.out}_{self.style}"

    @property
    def config_class_name(self) -> str:
        """The taxonomy name of this kernel's config class."""
        style = "".join(word.capitalize() for word in self.style.split("_"))
        parts = [self.arch, self.act, self.weight, self.out]
        return "_".join(p.capitalize() for p in parts) + f"_{style}_MegaMoeConfig"


def parse_kernel_name(name: str) -> KernelName:
    """Parse `name` into its taxonomy parts; `MoeEpUsageError` if it does not parse."""
    example = "e.g. 'sm90_fp8_fp8_bf16_pull_cutedsl' or 'any_bf16_bf16_bf16_torch'"
    if not isinstance(name, str):
        raise MoeEpUsageError(f"kernel name must be a str, got {type(name).__name__} ({name!r})")
    parts = name.split("_", 4)
    if len(parts) != 5:
        raise MoeEpUsageError(
            f"kernel name {name!r} does not parse as <arch>_<act>_<weight>_<out>_<style> "
            f"({example})"
        )
    arch, act, weight, out, style = parts
    if not _ARCH.match(arch):
        raise MoeEpUsageError(f"kernel name {name!r}: arch {arch!r} is not 'any' or 'smNN'")
    for role, tag in (("act", act), ("weight", weight), ("out", out)):
        if tag not in DTYPE_TAGS:
            raise MoeEpUsageError(
                f"kernel name {name!r}: {role} dtype {tag!r} is not one of {sorted(DTYPE_TAGS)}"
            )
    if not _STYLE.match(style):
        raise MoeEpUsageError(
            f"kernel name {name!r}: style {style!r} must be lowercase words joined by '_'"
        )
    return KernelName(arch, act, weight, out, style)

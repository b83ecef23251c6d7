"""No configuration field is accepted and ignored: each is read somewhere outside its own
validation.

A static check over the sources of `moe_ep`, `moe_ep_sm90` and `moe_ep_sm100`: every field
of `BootstrapConfig`, `FleetParams` and every kernel config class must be read as an
attribute (`x.field`) or through `getattr(x, "field", ...)` somewhere other than a
`__post_init__` (where a field is only validated). It is a net, not a proof: a read of
another object's attribute of the same name counts too; the behaviour of each field is
tested where it is used (for `stream`: `test_layer_stream.py`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from moe_ep.config import BootstrapConfig
from moe_ep.contract import KernelConfig
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "moe_ep": ROOT / "packages" / "moe-ep-core" / "src" / "moe_ep",
    "moe_ep_sm90": ROOT / "packages" / "moe-ep-backends-sm90" / "src" / "moe_ep_sm90",
    "moe_ep_sm100": ROOT / "packages" / "moe-ep-backends-sm100" / "src" / "moe_ep_sm100",
}
CONFIG_MODULES = (
    "moe_ep.backends.portable.configs",
    "moe_ep_sm90.common.config",
    "moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.config",
    "moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.config",
    "moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.config",
    "moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config",
    "moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.config",
    "moe_ep_sm100.common.config",
    "moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.config",
    "moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.config",
    "moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config",
    "moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.config",
)

REFUSED_UNLESS_DEFAULT = {
    "BootstrapConfig.nccl_comm": (lambda v: BootstrapConfig(world_size=1, rank=0, nccl_comm=v), 7),
    "BootstrapConfig.tcp_store": (lambda v: BootstrapConfig(world_size=1, rank=0, tcp_store=v), 0),
    "FleetParams.dtype_bytes": (lambda v: FleetParams(8, 16, 128, dtype_bytes=v), 1),
    "FleetParams.algorithm": (lambda v: FleetParams(8, 16, 128, algorithm=v), "split"),
    "FleetParams.layout": (lambda v: FleetParams(8, 16, 128, layout=v), "rank_major"),
    "FleetParams.tuning_live_tokens": (lambda v: FleetParams(8, 16, 128, tuning_live_tokens=v), 4),
    **{
        f"Sm90_Fp8_{fmt.capitalize()}_Bf16_PullCutedsl_MegaMoeConfig.{name}": (
            lambda v, fmt=fmt, name=name: _sm90_fp4_config(fmt)(**{name: v}),
            True,
        )
        for fmt in ("mxfp4", "nvfp4")
        for name in ("generate_c", "enable_in_kernel_fc2_reduce")
    },
}
"""Fields that accept only their default: flashinfer.moe_ep's, taken for signature
compatibility (docs/runtime.md), and the sm90 FP4 pull kernels' fixed contract. Never read,
which is right because any other value is refused; the test below proves each refusal, so
they are no hole in the net."""


def _sm90_fp4_config(fmt: str) -> type:
    module = importlib.import_module(f"moe_ep_sm90.kernels.sm90_fp8_{fmt}_bf16_pull_cutedsl.config")
    return getattr(module, f"Sm90_Fp8_{fmt.capitalize()}_Bf16_PullCutedsl_MegaMoeConfig")


class _Reads(ast.NodeVisitor):
    """Attribute names read outside `__post_init__` bodies."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self._in_post_init = 0

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        inside = node.name == "__post_init__"
        self._in_post_init += inside
        self.generic_visit(node)
        self._in_post_init -= inside

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not self._in_post_init and isinstance(node.ctx, ast.Load):
            self.names.add(node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            not self._in_post_init
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            self.names.add(node.args[1].value)
        self.generic_visit(node)


def _read_names() -> set[str]:
    reads = _Reads()
    for package in PACKAGES.values():
        for path in sorted(package.rglob("*.py")):
            reads.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return reads.names


def _subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _config_classes() -> list[type]:
    for module in CONFIG_MODULES:
        pytest.importorskip(module.split(".")[0])
        importlib.import_module(module)
    kernel_configs = sorted(
        {c for c in _subclasses(KernelConfig) if c.__module__ in CONFIG_MODULES},
        key=lambda c: c.__qualname__,
    )
    assert len(kernel_configs) >= 10, kernel_configs  # every taxonomy name has one
    return [BootstrapConfig, FleetParams, *kernel_configs]


def test_every_config_field_is_read_outside_its_validation() -> None:
    read = _read_names()
    unread = [
        f"{cls.__name__}.{f.name}"
        for cls in _config_classes()
        for f in dataclasses.fields(cls)
        if f.name not in read and f"{cls.__name__}.{f.name}" not in REFUSED_UNLESS_DEFAULT
    ]
    assert not unread, f"fields validated but never read: {unread}"


@pytest.mark.parametrize("field", sorted(REFUSED_UNLESS_DEFAULT))
def test_the_fields_that_only_take_their_default_refuse_any_other(field: str) -> None:
    build, other = REFUSED_UNLESS_DEFAULT[field]
    build(_default(field))  # the default is accepted
    with pytest.raises(MoeEpUsageError, match=field.split(".")[1]):
        build(other)


def _default(field: str) -> object:
    cls_name, name = field.split(".")
    (cls,) = [c for c in _config_classes() if c.__name__ == cls_name]
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    return f.default


def test_the_net_catches_a_field_read_only_in_post_init() -> None:
    """The check itself: a field that only `__post_init__` touches is reported."""
    reads = _Reads()
    reads.visit(
        ast.parse(
            "class C:\n"
            "    def __post_init__(self):\n"
            "        check(self.only_validated)\n"
            "    def run(self):\n"
            "        return self.used + getattr(self, 'used_by_name', 0)\n"
        )
    )
    assert {"used", "used_by_name"} <= reads.names
    assert "only_validated" not in reads.names

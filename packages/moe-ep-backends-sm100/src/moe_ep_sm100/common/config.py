"""What the configs of the sm100 kernels share (each kernel's config is in its folder).

Each config is frozen and keyword-only; `__post_init__` checks every knob on its own and
`check_problem()` checks the knobs against a layer's geometry. Both raise `MoeEpUsageError`
naming the field, the rule and the value, before anything is allocated or launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep.backends.support.config_checks import (
    WARP_DISPATCH_MAX_TOP_K,
    GeometryCheckedConfig,
    check_clamp,
    check_int,
    check_warp_dispatch_top_k,
)

__all__ = ["BLACKWELL_SM_COUNT", "CUTEDSL_MAX_TOP_K", "CutedslConfig", "Sm100Config"]

# B200 SM count; the default for max active clusters of a 1-CTA cluster.
BLACKWELL_SM_COUNT = 148

CUTEDSL_MAX_TOP_K = WARP_DISPATCH_MAX_TOP_K  # see support.config_checks


@dataclass(frozen=True, kw_only=True)
class Sm100Config(GeometryCheckedConfig):
    """Knobs shared by the sm100 kernels."""

    shape_multiple: ClassVar[int] = 64

    gate_up_clamp: float | None = None
    """SwiGLU clamp: gate <= c, -c <= up <= c; None = no clamp."""
    top_k: int | None = None
    """Routes per token, compiled into the kernel; set it so `warmup()` can compile ahead."""

    def __post_init__(self) -> None:
        check_clamp(self.gate_up_clamp, field="gate_up_clamp")
        if self.top_k is not None:
            check_int(self.top_k, field="top_k")


@dataclass(frozen=True, kw_only=True)
class CutedslConfig(Sm100Config):
    """Rules the two CuTe DSL kernels share: top_k <= `CUTEDSL_MAX_TOP_K`."""

    def _check_top_k(self, top_k: int) -> None:
        check_warp_dispatch_top_k(self.kernel_name, top_k)

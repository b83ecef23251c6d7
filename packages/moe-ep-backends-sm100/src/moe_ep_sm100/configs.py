"""Config dataclasses of the sm100 kernels (taxonomy names of DESIGN section 4).

Each config is frozen and keyword-only; `__post_init__` checks every knob on its own and
`check_problem()` checks the knobs against a layer's geometry. Both raise `MoeEpUsageError`
naming the field, the rule and the value, before anything is allocated or launched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from moe_ep.backends.support.configs import (
    WARP_DISPATCH_MAX_TOP_K,
    GeometryCheckedConfig,
    check_clamp,
    check_int,
    check_warp_dispatch_top_k,
)
from moe_ep.errors import MoeEpUsageError

__all__ = [
    "Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig",
    "Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig",
    "Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig",
]

# B200 SM count; the default for max active clusters of a 1-CTA cluster.
BLACKWELL_SM_COUNT = 148

CUTEDSL_MAX_TOP_K = WARP_DISPATCH_MAX_TOP_K  # see support.configs


@dataclass(frozen=True, kw_only=True)
class _Sm100Config(GeometryCheckedConfig):
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
class _CutedslConfig(_Sm100Config):
    """Rules the two CuTe DSL kernels share: top_k <= `CUTEDSL_MAX_TOP_K`."""

    def _check_top_k(self, top_k: int) -> None:
        check_warp_dispatch_top_k(self.kernel_name, top_k)


@dataclass(frozen=True, kw_only=True)
class Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig(_CutedslConfig):
    """Blackwell CuTe DSL mega-MoE, nvfp4 activations and weights (e2m1, 16-element e4m3
    block scales, per-tensor fp32 global scale applied as per-expert alpha).

    Hidden and intermediate sizes must be multiples of 64 (the drop's own rule).
    """

    kernel_name: ClassVar[str] = "sm100_nvfp4_nvfp4_bf16_cutedsl"

    input_norm_const: float = 1.0
    """Static global scale (norm const) of the FC1 input's nvfp4 quantization; must be the
    same on every rank (peers' tokens are dequantized with the local copy)."""
    hidden_norm_const: float = 1.0
    """Static global scale of the FC2 input (the SwiGLU output) quantization."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("input_norm_const", "hidden_norm_const"):
            v = getattr(self, field)
            bad = isinstance(v, bool) or not isinstance(v, int | float)
            if bad or not math.isfinite(v) or v <= 0:
                raise MoeEpUsageError(f"{field} must be finite and > 0 (e.g. 1.0), got {v!r}")


@dataclass(frozen=True, kw_only=True)
class Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig(_CutedslConfig):
    """Blackwell CuTe DSL mega-MoE (2-CTA), mxfp8 e4m3 with 32-element E8M0 block scales.

    Hidden and intermediate sizes must be multiples of 64 (the drop's own rule).
    """

    kernel_name: ClassVar[str] = "sm100_mxfp8_mxfp8_bf16_cutedsl"


@dataclass(frozen=True, kw_only=True)
class Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig(_Sm100Config):
    """DeepGEMM's Blackwell mega-MoE: fp8 activations (1x32 UE8M0), fp4 weights.

    Hidden and intermediate sizes must be multiples of 512 (DeepGEMM's mega-MoE rule, read
    from its sources; see docs/backends.md).
    """

    kernel_name: ClassVar[str] = "sm100_fp8_fp4_bf16_deepgemm"
    shape_multiple: ClassVar[int] = 512

"""`Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig`: the MXFP4 x FP8 pull kernel's knobs and its
fixed contract (the drop's `Sm90MegaMoESwapABMxfp4Fp8Kernel`).

Fixed by the kernel, refused otherwise: `fp8_scale_mode="mxfp4_hybrid"` (one fp32 FC1
activation scale per token), swap-AB only, `generate_c=False`, bf16 combine, no in-kernel
FC2 reduce, H and I multiples of 128 (its K128 stages and 64x128 offset folds). The drop's
optional `fc2_tail_n8` / `fc1_ready_mode="k256"` protocols (qualified for one geometry each,
`mxfp4_policy.resolve_mxfp4_optimizations`) are not offered: the kernel runs their defaults.

`gate_up_clamp` is honoured, with upstream's default: flashinfer 0.7.4's config of this
kernel sets 10.0 (its "canonical MXFP4 tuning/benchmark contract"; `None` turns it off), and
the value is compiled into the drop's kernel (`gate <= c`, `-c <= up <= c` before SwiGLU,
as the portable twin's `swiglu_clamp`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.common.pull_tiles import PullTileConfig

__all__ = ["MXFP4_K_TILE", "Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig"]

MXFP4_K_TILE = 128
"""K elements per mainloop stage and per offset fold (the drop's `MXFP4_K_TILE`)."""

_FIXED: tuple[tuple[str, object, str], ...] = (
    ("fp8_scale_mode", "mxfp4_hybrid", "one fp32 FC1 activation scale per token"),
    ("generate_c", False, "the MXFP4 kernel writes no FC1 output tensor"),
    ("combine_format", "bf16", "the MXFP4 kernel combines in bf16 only"),
    ("enable_in_kernel_fc2_reduce", False, "the top-k reduce runs after the kernel"),
)


@dataclass(frozen=True, kw_only=True)
class Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig(PullTileConfig):
    """Hopper pull-style CuTe DSL mega-MoE, e4m3 activations x mxfp4 weights (`mxfp4_hybrid`;
    the portable twin is `any_fp8_mxfp4_bf16_torch`). Swap-AB only; tile (128, 64, 128) by
    default (ours, not tuned). Never run on a GPU."""

    kernel_name: ClassVar[str] = "sm90_fp8_mxfp4_bf16_pull_cutedsl"
    tile_k_multiple: ClassVar[int] = MXFP4_K_TILE
    tile_k_why: ClassVar[str] = "the MXFP4 kernel's K128 stage"
    shape_multiple: ClassVar[int] = MXFP4_K_TILE
    shape_multiple_why: ClassVar[str] = "the MXFP4 kernel's K128 stages and 64x128 offset folds"

    gate_up_clamp: float | None = 10.0
    """SwiGLU clamp compiled into the kernel (upstream's default 10.0; None = no clamp)."""
    swap_ab: bool = True
    mma_tiler_mnk: tuple[int, int, int] = (128, 64, 128)
    fp8_scale_mode: str = "mxfp4_hybrid"
    generate_c: bool = False
    combine_format: str = "bf16"
    enable_in_kernel_fc2_reduce: bool = False

    def __post_init__(self) -> None:
        if self.swap_ab is not True:
            raise MoeEpUsageError(
                f"swap_ab must be True for {self.kernel_name} (the MXFP4 kernel is swap-AB "
                f"only), got {self.swap_ab!r}"
            )
        for field, value, why in _FIXED:
            got = getattr(self, field)
            if type(got) is not type(value) or got != value:
                raise MoeEpUsageError(
                    f"{field} must be {value!r} for {self.kernel_name} ({why}), got {got!r}"
                )
        self._check_tiles()

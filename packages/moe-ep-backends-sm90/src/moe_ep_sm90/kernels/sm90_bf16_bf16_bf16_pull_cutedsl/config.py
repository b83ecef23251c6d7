"""`Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig`: the bf16 pull kernel's knobs (the drop's
compile-time geometry) and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.common.pull_tiles import PullTileConfig

__all__ = ["BF16_HIDDEN_MULTIPLE", "BF16_TILE_K", "Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig"]

BF16_TILE_K = 64
"""The drop's `Bf16TmaAtomK`: 64 two-byte elements per 128-byte swizzle row."""
BF16_HIDDEN_MULTIPLE = 256
"""H must fill the largest FC2 N tile (flashinfer 0.7.4's own wrapper of this kernel asks
the same, after the drop's test harness)."""


@dataclass(frozen=True, kw_only=True)
class Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig(PullTileConfig):
    """Hopper pull-style CuTe DSL mega-MoE, bf16 activations and weights, bf16 combine.

    No quantization anywhere: bf16 WGMMA with fp32 accumulation, the SwiGLU output (times
    the top-k weight) rounded to bf16 before FC2, per-(token, slot) bf16 combine cells
    summed in fp32 by the drop's top-k reduce. Knobs mirror the drop's compile-time
    geometry; defaults are the drop driver's manual ones (native layout, tile
    (64, 128, 64), cluster (1, 1, 1)). H must be a multiple of 256, I of 128.
    """

    kernel_name: ClassVar[str] = "sm90_bf16_bf16_bf16_pull_cutedsl"
    shape_multiple: ClassVar[int] = 128
    shape_multiple_why: ClassVar[str] = "2I fills the kernel's largest FC1 N tile, 256"
    tile_k_multiple: ClassVar[int] = BF16_TILE_K
    tile_k_why: ClassVar[str] = "the bf16 TMA swizzle atom"

    mma_tiler_mnk: tuple[int, int, int] = (64, 128, 64)

    def __post_init__(self) -> None:
        self._check_tiles()

    def check_problem(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        num_experts: int,
        world_size: int,
        max_tokens_per_rank: int,
    ) -> None:
        """`GeometryCheckedConfig.check_problem`, and H a multiple of 256."""
        super().check_problem(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            top_k=top_k,
            num_experts=num_experts,
            world_size=world_size,
            max_tokens_per_rank=max_tokens_per_rank,
        )
        if hidden_size % BF16_HIDDEN_MULTIPLE:
            raise MoeEpUsageError(
                f"{self.kernel_name}: hidden_size must be a multiple of {BF16_HIDDEN_MULTIPLE} "
                f"(the kernel's largest FC2 N tile), got {hidden_size}"
            )

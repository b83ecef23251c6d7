"""`Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig`: the pull kernel's knobs (the drop's
compile-time geometry) and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep.backends.support.config_checks import (
    check_choice,
    check_clamp,
    check_int,
    check_warp_dispatch_top_k,
)
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.common.config import (
    FP8_BLOCK,
    GATE_UP_BLOCKS,
    HOPPER_SM_COUNT,
    Fp8BlockwiseConfig,
)

__all__ = ["PULL_GATE_UP_BLOCK", "Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig"]

# The pull kernel folds FC1 rows as [pair, {gate, up}, 8] (its Fp8GateUpInterleave).
PULL_GATE_UP_BLOCK = 8

_PULL_NATIVE_TILE_M = (64,)
_PULL_NATIVE_TILE_N = (128, 256)
_PULL_SWAP_TILE_M = (128, 256)
_PULL_SWAP_TILE_N = (8, 16, 32, 64, 128)
_PULL_CLUSTERS_MN = ((1, 1), (2, 1), (1, 2), (2, 2))
_ACCUM_MODES = ("1xacc", "2xacc")
_LOAD_BALANCE = ("static", "atomic_counter")


@dataclass(frozen=True, kw_only=True)
class Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(Fp8BlockwiseConfig):
    """Hopper pull-style CuTe DSL mega-MoE, fp8 e4m3 blockwise (1x128 FC1 input, 128x128
    weights; in the kernel the FC2 input is quantized 1x64, the drop's Fp8Fc2ActivationScaleK).

    Knobs mirror the drop's compile-time geometry. Defaults are the drop driver's manual
    defaults (native layout, tile (64, 128, 128), cluster (1, 1, 1)).
    """

    kernel_name: ClassVar[str] = "sm90_fp8_fp8_bf16_pull_cutedsl"

    accum_mode: str = "1xacc"
    """fp8 WGMMA accumulation: "1xacc" or "2xacc" (promotes partial sums twice as often)."""
    gate_up_clamp: float | None = None
    """SwiGLU clamp: gate <= c, -c <= up <= c; None = no clamp."""
    swap_ab: bool = False
    """Swap-AB geometry (tokens on the MMA N side); better for few tokens per expert."""
    mma_tiler_mnk: tuple[int, int, int] = (64, 128, 128)
    cluster_shape_mnk: tuple[int, int, int] = (1, 1, 1)
    load_balance_mode: str = "static"
    max_active_clusters: int | None = None
    """None = the H100/H200 SM count (132) for a 1x1x1 cluster."""
    top_k: int | None = None
    """Routes per token, compiled into the kernel; set it so `warmup()` can compile ahead,
    else the first forward compiles."""
    prequantized_fc1_gate_up_interleave: int | None = None
    """For a pre-quantized weight pack only (refused with bf16/fp32 weights): the FC1 row
    grouping its `w13_scale` was computed over. None: canonical 128x128 blocks over the
    stored gate-then-up rows (DeepSeek-V3 checkpoints, the portable fp8 backend's packs);
    usable only where each gate row block's scales equal the up block's at the same offset.
    8, 16 or 32: rows gate/up-interleaved in blocks of that size before blocking (the
    kernel's own grouping; the same scale blocks for all three). See
    `moe_ep_sm90.common.fp8_packs`."""

    def _check_top_k(self, top_k: int) -> None:
        check_warp_dispatch_top_k(self.kernel_name, top_k)

    def __post_init__(self) -> None:
        if self.top_k is not None:
            check_int(self.top_k, field="top_k")
        b = self.prequantized_fc1_gate_up_interleave
        if b is not None and (type(b) is not int or b not in GATE_UP_BLOCKS):
            raise MoeEpUsageError(
                f"prequantized_fc1_gate_up_interleave must be None or one of {GATE_UP_BLOCKS}, "
                f"got {b!r} (e.g. 8 for a pack quantized as the kernel does)"
            )
        check_choice(self.accum_mode, _ACCUM_MODES, field="accum_mode")
        check_clamp(self.gate_up_clamp, field="gate_up_clamp")
        if not isinstance(self.swap_ab, bool):
            raise MoeEpUsageError(f"swap_ab must be a bool, got {self.swap_ab!r}")
        check_choice(self.load_balance_mode, _LOAD_BALANCE, field="load_balance_mode")
        for field, value in (
            ("mma_tiler_mnk", self.mma_tiler_mnk),
            ("cluster_shape_mnk", self.cluster_shape_mnk),
        ):
            if not (isinstance(value, tuple) and len(value) == 3):
                raise MoeEpUsageError(f"{field} must be a tuple of 3 ints, got {value!r}")
            for v in value:
                check_int(v, field=field)
        m, n, k = self.mma_tiler_mnk
        ms, ns = (
            (_PULL_SWAP_TILE_M, _PULL_SWAP_TILE_N)
            if self.swap_ab
            else (_PULL_NATIVE_TILE_M, _PULL_NATIVE_TILE_N)
        )
        if m not in ms or n not in ns:
            layout = "swap-AB" if self.swap_ab else "native"
            raise MoeEpUsageError(
                f"mma_tiler_mnk for the {layout} layout needs M in {ms} and N in {ns}, "
                f"got {self.mma_tiler_mnk}"
            )
        if k % FP8_BLOCK != 0:
            raise MoeEpUsageError(
                f"mma_tiler_mnk K must be a multiple of {FP8_BLOCK}, got {self.mma_tiler_mnk}"
            )
        cm, cn, ck = self.cluster_shape_mnk
        if ck != 1 or (cm, cn) not in _PULL_CLUSTERS_MN:
            raise MoeEpUsageError(
                f"cluster_shape_mnk must be (m, n, 1) with (m, n) in {_PULL_CLUSTERS_MN}, "
                f"got {self.cluster_shape_mnk}"
            )
        if self.max_active_clusters is not None:
            check_int(self.max_active_clusters, field="max_active_clusters")

    @property
    def resolved_max_active_clusters(self) -> int:
        """`max_active_clusters`, else the H100/H200 SM count divided by the cluster size."""
        if self.max_active_clusters is not None:
            return self.max_active_clusters
        cm, cn, ck = self.cluster_shape_mnk
        return HOPPER_SM_COUNT // (cm * cn * ck)

    @property
    def token_padding_block(self) -> int:
        """Rows per expert segment in the dispatch pool: the physical token tile."""
        return self.mma_tiler_mnk[1] if self.swap_ab else self.mma_tiler_mnk[0]

"""What the configs of the two sm90 pull kernels (fp8 and bf16, one drop) share: the launch
geometry knobs of the drop's fused FC1+FC2 bases and their rules.

Both drop bases accept the same tiles (`moe_hopper_{fp8,bf16}/epilogue_*`: native M 64,
N 128/256; swap-AB M 128/256, N 8..128) and clusters ((1|2, 1|2, 1)); they differ in the
tile-K multiple (fp8: its 128-element scale block; bf16: the 64-element TMA swizzle atom),
which each config names in `tile_k_multiple`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep.backends.support.config_checks import (
    GeometryCheckedConfig,
    check_choice,
    check_clamp,
    check_int,
    check_warp_dispatch_top_k,
)
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.common.config import HOPPER_SM_COUNT

__all__ = ["PULL_GATE_UP_BLOCK", "PullTileConfig"]

PULL_GATE_UP_BLOCK = 8
"""Both pull kernels fold FC1 rows as [pair, {gate, up}, 8] (the drop's
`Fp8GateUpInterleave`, its PostSwigluHalf fold in the fp8 and the bf16 epilogues)."""

_NATIVE_TILE_M = (64,)
_NATIVE_TILE_N = (128, 256)
_SWAP_TILE_M = (128, 256)
_SWAP_TILE_N = (8, 16, 32, 64, 128)
_CLUSTERS_MN = ((1, 1), (2, 1), (1, 2), (2, 2))
_LOAD_BALANCE = ("static", "atomic_counter")


@dataclass(frozen=True, kw_only=True)
class PullTileConfig(GeometryCheckedConfig):
    """Launch geometry of an sm90 pull kernel: tiles, cluster, scheduling, clamp, top_k."""

    tile_k_multiple: ClassVar[int]
    tile_k_why: ClassVar[str]

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

    def _check_top_k(self, top_k: int) -> None:
        check_warp_dispatch_top_k(self.kernel_name, top_k)

    def _check_tiles(self) -> None:
        """The knob rules above (`MoeEpUsageError` naming the field, rule and value)."""
        if self.top_k is not None:
            check_int(self.top_k, field="top_k")
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
        ms, ns = (_SWAP_TILE_M, _SWAP_TILE_N) if self.swap_ab else (_NATIVE_TILE_M, _NATIVE_TILE_N)
        if m not in ms or n not in ns:
            layout = "swap-AB" if self.swap_ab else "native"
            raise MoeEpUsageError(
                f"mma_tiler_mnk for the {layout} layout needs M in {ms} and N in {ns}, "
                f"got {self.mma_tiler_mnk}"
            )
        if k % self.tile_k_multiple != 0:
            raise MoeEpUsageError(
                f"mma_tiler_mnk K must be a multiple of {self.tile_k_multiple} "
                f"({self.tile_k_why}), got {self.mma_tiler_mnk}"
            )
        cm, cn, ck = self.cluster_shape_mnk
        if ck != 1 or (cm, cn) not in _CLUSTERS_MN:
            raise MoeEpUsageError(
                f"cluster_shape_mnk must be (m, n, 1) with (m, n) in {_CLUSTERS_MN}, "
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

"""The push protocol's symmetric-window layout (pure arithmetic, no GPU).

The push drop's kernels take the window's layout as 21 scalars on every launch
(`LAYOUT_PARAMS` in `a2a/sm90_push_a2a_ops.cu`): the device array of peer base pointers,
the geometry, and the byte offset of every region of the per-rank window. Regions, in
window order, each starting on a 128-byte boundary:

- pool: `pool_rows` received token rows of `bytes_per_row` (fp8 payload: `H` bytes);
- pool scales: `pool_rows * H/128` fp32 (fp8 payload only);
- pool meta: `meta_rows` records of 16 bytes;
- pool head: one uint64 reservation head, then one uint64 abort cell;
- base / count / cdone / ack cells: uint64 per source rank (count: per local expert and
  source rank);
- combine inbox: bf16 `[T, k, H]` partials (bf16 combine), or fp8 `[T, slots, H]` with fp32
  `[T, slots, H/128]` scales (fp8 combine).

Only the configuration this package launches is covered: fp8 payload, no dispatch dedup,
no grouped combine. The arithmetic follows the drop's own host code (FlashInfer's
`Sm90PushPipe`); `check()` mirrors the kernels' `check_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_ep.errors import MoeEpUsageError

__all__ = ["MAX_EP_SIZE", "PUSH_TOP_K", "PushLayout", "push_window"]

MAX_EP_SIZE = 32
PUSH_TOP_K = (1, 2, 4, 6, 8)
_ALIGN = 128
_CELL = 8  # uint64
_META = 16


def _align(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class PushLayout:
    """One rank's window layout; `launch_args(peer_bases)` gives the 21 kernel scalars."""

    ep_size: int
    rank: int
    num_local_experts: int
    hidden: int
    top_k: int
    token_capacity: int
    fp8_combine: bool
    pool_rows: int
    meta_rows: int
    bytes_per_row: int
    pool_offset: int
    pool_sc_offset: int
    pool_meta_offset: int
    pool_head_offset: int
    base_cells_offset: int
    count_cells_offset: int
    cdone_cells_offset: int
    ack_cells_offset: int
    combine_offset: int
    cfp8_offset: int
    csc_offset: int
    total_bytes: int

    @property
    def m_cap(self) -> int:
        """GEMM row capacity on this rank (= meta records it can receive)."""
        return self.meta_rows

    def launch_args(self, peer_bases: int) -> tuple[int, ...]:
        """`LAYOUT_PARAMS` in the kernels' order."""
        return (
            peer_bases,
            self.ep_size,
            self.rank,
            self.num_local_experts,
            self.pool_rows,
            self.meta_rows,
            self.bytes_per_row,
            self.hidden,
            self.top_k,
            self.token_capacity,
            self.pool_offset,
            self.pool_sc_offset,
            self.pool_meta_offset,
            self.pool_head_offset,
            self.base_cells_offset,
            self.count_cells_offset,
            self.cdone_cells_offset,
            self.ack_cells_offset,
            self.combine_offset,
            self.cfp8_offset,
            self.csc_offset,
        )


def push_window(
    *,
    ep_size: int,
    rank: int,
    num_local_experts: int,
    hidden: int,
    top_k: int,
    token_capacity: int,
    fp8_combine: bool = False,
    capacity_factor: float = 1.0,
) -> PushLayout:
    """The window layout for one rank; `MoeEpUsageError` for what the kernels refuse."""
    if not 1 <= ep_size <= MAX_EP_SIZE:
        raise MoeEpUsageError(f"ep_size must be in [1, {MAX_EP_SIZE}], got {ep_size}")
    if not 0 <= rank < ep_size:
        raise MoeEpUsageError(f"rank must be in [0, {ep_size}), got {rank}")
    if num_local_experts < 1 or token_capacity < 1:
        raise MoeEpUsageError(
            f"num_local_experts and token_capacity must be >= 1, got {num_local_experts}, "
            f"{token_capacity}"
        )
    if hidden < 128 or hidden % 128:
        raise MoeEpUsageError(f"hidden must be a positive multiple of 128, got {hidden}")
    if top_k not in PUSH_TOP_K:
        raise MoeEpUsageError(f"top_k must be one of {PUSH_TOP_K} for the push drop, got {top_k}")
    if not 0.0 < capacity_factor <= 1.0:
        raise MoeEpUsageError(f"capacity_factor must be in (0, 1], got {capacity_factor}")
    max_routes = ep_size * token_capacity * top_k
    if max_routes > 2**31 - 1:
        raise MoeEpUsageError(
            f"ep_size * token_capacity * top_k = {max_routes} overflows the packed counter"
        )
    meta_rows = max(int(capacity_factor * max_routes), 1)
    pool_rows = meta_rows  # no dedup: one pool row per received route
    bytes_per_row = hidden  # fp8 payload
    nkb = hidden // 128
    slots = top_k  # no grouped combine

    off = 0
    pool = off
    off = _align(off + pool_rows * bytes_per_row)
    pool_sc = off
    off = _align(off + pool_rows * nkb * 4)
    pool_meta = off
    off = _align(off + meta_rows * _META)
    pool_head = off
    off = _align(off + _CELL)
    if off < pool_head + 2 * _CELL:  # the abort cell lives in the head's padding
        raise AssertionError("pool-head padding must hold the abort cell")
    base_cells = off
    off = _align(off + ep_size * _CELL)
    count_cells = off
    off = _align(off + num_local_experts * ep_size * _CELL)
    cdone_cells = off
    off = _align(off + ep_size * _CELL)
    ack_cells = off
    off = _align(off + ep_size * _CELL)
    combine = off
    off = _align(off + (0 if fp8_combine else token_capacity * top_k * hidden * 2))
    cfp8 = off
    off = _align(off + (token_capacity * slots * hidden if fp8_combine else 0))
    csc = off
    off = _align(off + (token_capacity * slots * nkb * 4 if fp8_combine else 0))
    return PushLayout(
        ep_size=ep_size,
        rank=rank,
        num_local_experts=num_local_experts,
        hidden=hidden,
        top_k=top_k,
        token_capacity=token_capacity,
        fp8_combine=fp8_combine,
        pool_rows=pool_rows,
        meta_rows=meta_rows,
        bytes_per_row=bytes_per_row,
        pool_offset=pool,
        pool_sc_offset=pool_sc,
        pool_meta_offset=pool_meta,
        pool_head_offset=pool_head,
        base_cells_offset=base_cells,
        count_cells_offset=count_cells,
        cdone_cells_offset=cdone_cells,
        ack_cells_offset=ack_cells,
        combine_offset=combine,
        cfp8_offset=cfp8,
        csc_offset=csc,
        total_bytes=off,
    )

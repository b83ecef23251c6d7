"""Which physical slot each (token, choice) goes to under a `Placement` (docs/placement.md).

The rule (the same on every rank and at every world size, so the bits do not depend on it):
the pairs routed to logical expert e, in global (source rank, token, slot) order, are
numbered `0 .. c_e - 1`, where `c_e` is e's pair count over all ranks. With `c_e <=
spread_rows` (the experts compute such an expert's rows independently of one another) pair
number i goes to e's replica `i mod R_e`; above it, whole runs of `row_block` pairs do
(run j to replica `j mod R_e`), so every GEMM block the contiguous layout would run is run
by one replica, with the same rows in the same order. An expert with one copy takes all its
pairs, and then no count over ranks is needed.
"""

from __future__ import annotations

import torch

from moe_ep.placement import Placement

__all__ = ["expert_pair_counts", "replica_table", "route_to_slots"]


def expert_pair_counts(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[E]` int64: the valid (token, slot) pairs of `topk_ids [n, k]` per logical expert
    (`-1` slots skipped; an expert twice in a row counts twice)."""
    flat = topk_ids.reshape(-1)
    return torch.bincount(flat[flat >= 0].long(), minlength=num_experts)


def replica_table(placement: Placement, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(`[E, R_max]` int64 physical slots per expert, replica order, padded with replica 0;
    `[E]` int64 copies per expert). A masked expert's row is `-1` with one "copy", so its
    pairs route to `-1` (nowhere)."""
    reps = [r or (-1,) for r in placement.replicas]
    most = max(len(r) for r in reps)
    table = torch.tensor([list(r) + [r[0]] * (most - len(r)) for r in reps], dtype=torch.int64)
    copies = torch.tensor([len(r) for r in reps], dtype=torch.int64)
    return table.to(device), copies.to(device)


def route_to_slots(
    topk_ids: torch.Tensor,
    table: tuple[torch.Tensor, torch.Tensor],
    *,
    rank_counts: torch.Tensor | None,
    rank: int,
    spread_rows: int,
    row_block: int,
) -> torch.Tensor:
    """`[n, k]` int64 physical slot of each pair of `topk_ids [n, k]` (`-1` stays `-1`).

    table: `replica_table(placement)`.
    rank_counts: `[W, E]` int64, every rank's `expert_pair_counts` (rank order); None when
        no expert has more than one copy (replica 0 takes every pair).
    rank: this rank (its pairs follow those of ranks `< rank` in the numbering).
    """
    slots, copies = table
    flat = topk_ids.reshape(-1).long()
    valid = flat >= 0
    ids = flat[valid]  # token-major: (token, slot) order
    if rank_counts is None:
        chosen = slots[ids, 0]
    else:
        e = int(slots.shape[0])
        mine = torch.bincount(ids, minlength=e)
        order = torch.sort(ids, stable=True).indices
        start = torch.cumsum(mine, 0) - mine
        within = torch.empty_like(ids)
        within[order] = torch.arange(int(ids.numel()), device=ids.device) - start[ids[order]]
        before = rank_counts[:rank].sum(0)
        total = rank_counts.sum(0)[ids]
        number = before[ids] + within
        run = torch.where(
            total <= spread_rows, number, torch.div(number, row_block, rounding_mode="floor")
        )
        chosen = slots[ids, run % copies[ids]]
    out = torch.full_like(flat, -1)
    out[valid] = chosen
    return out.view(topk_ids.shape)

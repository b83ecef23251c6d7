"""Collective re-placement of a weight pack: each rank's new slots' weights, over the group.

For every tensor of the pack (`placement_weights.PACK_FIELDS`), one uneven
`all_to_all_single` of per-slot byte rows: rank s sends rank d, in d's slot order, the rows
of d's new slots whose source (`placement_weights.transfer_sources`) is one of s's old
slots; a slot whose source is on its own rank travels the all-to-all's self split (no
network). Each wait is bounded by the runtime's timeout; a group of one rank moves nothing
over the wire.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moe_ep.placement import Placement
from moe_ep.placement_weights import PACK_FIELDS
from moe_ep.runtime import post_and_wait
from moe_ep.types import MoEWeightPack

__all__ = ["move_weights"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`[S, ...]` any dtype -> `[S, bytes per slot]` uint8 (a view where contiguous)."""
    return t.contiguous().reshape(int(t.shape[0]), -1).view(torch.uint8)


def move_weights(
    runtime: Any,
    pack: MoEWeightPack,
    old: Placement,
    new: Placement,
    sources: list[int],
) -> MoEWeightPack:
    """Collective: this rank's pack under `new` (`[S_new, ...]` per tensor, on the runtime's
    device), from every rank's `pack` under `old`; `sources[q]` is the old slot whose
    weights new slot q takes (the same list on every rank)."""
    rank, world = runtime.rank, runtime.world_size
    s_old, s_new = old.slots_per_rank, new.slots_per_rank
    # (new slot q, source old slot) pairs sent by this rank, grouped by destination rank
    send = [
        [sources[q] - rank * s_old for q in range(d * s_new, (d + 1) * s_new)
         if old.rank_of_slot(sources[q]) == rank]
        for d in range(world)
    ]  # fmt: skip
    mine = range(rank * s_new, (rank + 1) * s_new)
    recv_from = [[q for q in mine if old.rank_of_slot(sources[q]) == s] for s in range(world)]
    order = torch.tensor([q - rank * s_new for src in recv_from for q in src], dtype=torch.int64)
    send_index = torch.tensor([i for dest in send for i in dest], dtype=torch.int64)
    parts: dict[str, torch.Tensor | None] = {}
    for name in PACK_FIELDS:
        t = getattr(pack, name)
        if t is None:
            parts[name] = None
            continue
        src = t.to(runtime.device)
        rows = _rows(src).index_select(0, send_index.to(src.device))
        if world == 1:
            got = rows
        else:
            got = torch.empty((s_new, int(rows.shape[1])), dtype=torch.uint8, device=src.device)
            _all_to_all(
                runtime,
                got,
                rows,
                [len(r) for r in recv_from],
                [len(d) for d in send],
                what=f"moe-ep apply_placement ({name})",
            )
        placed = torch.empty_like(got)
        placed.index_copy_(0, order.to(got.device), got)
        parts[name] = placed.view(src.dtype).reshape((s_new, *src.shape[1:]))
    return MoEWeightPack(**parts)  # type: ignore[arg-type]


def _all_to_all(
    runtime: Any,
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    *,
    what: str,
) -> None:
    group = runtime.group
    post_and_wait(
        group,
        lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True),
        what=what,
        rank=runtime.rank,
    )

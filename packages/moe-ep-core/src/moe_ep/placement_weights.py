"""Weight packs under a `Placement`: a rank's slots' weights, and where re-placed ones come from.

Who builds a rank's pack: the caller (as without a placement): `slice_weights` takes the
full `[E, ...]` weights (every logical expert) and returns rank r's `[S, ...]` pack in slot
order. `MoEEpLayer.apply_placement` moves packs between placements itself
(`transfer_sources` says which rank sends each new slot's weights).
"""

from __future__ import annotations

import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep.placement import Placement
from moe_ep.types import MoEWeightPack

__all__ = ["PACK_FIELDS", "slice_weights", "transfer_sources"]

PACK_FIELDS = ("w13", "w2", "w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale")
"""The `MoEWeightPack` tensors, each with one leading entry per expert (slot)."""


def slice_weights(full: MoEWeightPack, placement: Placement, rank: int) -> MoEWeightPack:
    """Rank `rank`'s pack: entry s of every tensor is logical expert
    `placement.rank_slots(rank)[s]`'s entry of `full` (`[E, ...]`, every expert once)."""
    if not isinstance(full, MoEWeightPack):
        raise MoeEpUsageError(f"full must be a MoEWeightPack, got {type(full).__name__}")
    if not isinstance(placement, Placement):
        raise MoeEpUsageError(f"placement must be a Placement, got {type(placement).__name__}")
    index = torch.tensor(placement.rank_slots(rank), dtype=torch.int64)
    parts: dict[str, torch.Tensor | None] = {}
    for name in PACK_FIELDS:
        t = getattr(full, name)
        if t is not None and int(t.shape[0]) != placement.num_experts:
            raise MoeEpUsageError(
                f"full.{name} must hold every expert (leading dim num_experts="
                f"{placement.num_experts}), got shape {tuple(t.shape)}"
            )
        parts[name] = None if t is None else t.index_select(0, index.to(t.device))
    return MoEWeightPack(**parts)  # type: ignore[arg-type]


def transfer_sources(old: Placement, new: Placement) -> list[int]:
    """Per slot of `new`, the old slot whose weights it takes: the one on the same rank when
    that rank held the expert (no transfer), else the expert's lowest old slot (replica 0)."""
    if not isinstance(new, Placement):
        raise MoeEpUsageError(f"placement must be a Placement, got {type(new).__name__}")
    if (new.num_experts, new.world_size) != (old.num_experts, old.world_size):
        raise MoeEpUsageError(
            f"a new placement must keep num_experts and world_size: the layer has "
            f"({old.num_experts}, {old.world_size}), got ({new.num_experts}, {new.world_size})"
        )
    lost = sorted(set(new.slots) & set(old.masked))
    if lost:
        raise MoeEpUsageError(
            f"the new placement holds experts {lost}, which the layer's placement has masked "
            "(their weights were lost with the failed ranks): keep them masked"
        )
    sources = []
    for p, e in enumerate(new.slots):
        rank = new.rank_of_slot(p)
        local = [q for q in old.replicas[e] if old.rank_of_slot(q) == rank]
        sources.append(local[0] if local else old.replicas[e][0])
    return sources

"""`Placement`: which logical experts each rank holds, in which physical slots (docs/placement.md).

A placement of `E` logical experts over `W` ranks is a tuple of `W * S` physical slots,
rank r holding slots `[r*S, (r+1)*S)`; slot p holds logical expert `slots[p]`. Every expert
has at least one copy; an expert with several copies (replicas, "redundant experts") has
its tokens spread over them. The contiguous layout (`Placement.contiguous`) is `slots[p] ==
p` with `S = E / W`, what `FleetParams` means without a placement.

Plain data, no torch: the balancer is `moe_ep.placement_balance`, the weight slicing
`moe_ep.placement_weights`, the per-token replica choice `moe_ep.placement_routing`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from moe_ep.errors import MoeEpUsageError

__all__ = ["Placement"]


def _check_count(name: str, value: object, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MoeEpUsageError(f"{name} must be an int >= 1, got {value!r} (e.g. {example})")
    return value


@dataclass(frozen=True)
class Placement:
    """Logical experts -> physical slots on ranks, with optional replicas.

    Args:
        num_experts: E, the logical experts (what `topk_ids` name).
        world_size: W, the EP ranks.
        slots: `W * S` logical expert ids, slot p on rank `p // S`; every expert in `[0, E)`
            not in `masked` appears at least once and at most once per rank (a second copy
            on the same rank would add memory and spread nothing).
        masked: experts with no copy (sorted, in no slot): what mask-mode eviction leaves
            when every copy of an expert was on failed ranks; the layer routes their pairs
            nowhere (they contribute zero). Empty unless said, so a layout missing an
            expert is never taken for a valid one.

    Raises:
        MoeEpUsageError: naming the argument, the value and the rule.
    """

    num_experts: int
    world_size: int
    slots: tuple[int, ...]
    masked: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        e = _check_count("num_experts", self.num_experts, "256")
        w = _check_count("world_size", self.world_size, "8")
        if not isinstance(self.slots, tuple) or not all(
            type(s) is int for s in self.slots
        ):  # a list would make the record unhashable; numpy ints would not JSON
            raise MoeEpUsageError(
                f"slots must be a tuple of ints, got {type(self.slots).__name__} "
                "(e.g. Placement(8, 2, tuple(range(8))))"
            )
        n = len(self.slots)
        if n == 0 or n % w:
            raise MoeEpUsageError(
                f"slots must hold world_size * slots_per_rank entries (the same number of "
                f"slots on every rank): got {n} slots for world_size={w}"
            )
        bad = [(p, s) for p, s in enumerate(self.slots) if not 0 <= s < e]
        if bad:
            p, s = bad[0]
            raise MoeEpUsageError(
                f"slots must name logical experts in [0, num_experts={e}): slot {p} holds {s}"
            )
        self._check_masked(e)
        missing = sorted(set(range(e)) - set(self.slots) - set(self.masked))
        if missing:
            raise MoeEpUsageError(
                f"every expert needs at least one slot: experts {missing[:8]} have none "
                f"(num_experts={e}, {n} slots)"
            )
        per = n // w
        for r in range(w):
            held = self.slots[r * per : (r + 1) * per]
            if len(set(held)) != per:
                dup = next(x for x in held if held.count(x) > 1)
                raise MoeEpUsageError(
                    f"a rank holds at most one copy of an expert: rank {r} holds expert {dup} "
                    f"{held.count(dup)} times (slots {list(held)})"
                )

    def _check_masked(self, e: int) -> None:
        m = self.masked
        if not isinstance(m, tuple) or not all(type(x) is int for x in m):
            raise MoeEpUsageError(f"masked must be a tuple of ints, got {type(m).__name__}")
        if list(m) != sorted(set(m)) or any(not 0 <= x < e for x in m):
            raise MoeEpUsageError(
                f"masked must list distinct experts in [0, num_experts={e}) in increasing "
                f"order, got {list(m)}"
            )
        held = sorted(set(m) & set(self.slots))
        if held:
            raise MoeEpUsageError(
                f"a masked expert has no copy, but experts {held} are masked and in slots"
            )

    @classmethod
    def contiguous(cls, num_experts: int, world_size: int) -> Placement:
        """Rank r holds experts `[r*E/W, (r+1)*E/W)`, one copy each (`E % W == 0`)."""
        e = _check_count("num_experts", num_experts, "256")
        w = _check_count("world_size", world_size, "8")
        if e % w:
            raise MoeEpUsageError(
                f"the contiguous placement needs num_experts divisible by world_size: got "
                f"num_experts={e}, world_size={w}"
            )
        return cls(e, w, tuple(range(e)))

    @classmethod
    def from_rank_slots(cls, num_experts: int, rank_slots: Sequence[Sequence[int]]) -> Placement:
        """From one list of logical experts per rank (`rank_slots[r]`: rank r's slots)."""
        flat = tuple(int(s) for held in rank_slots for s in held)
        lengths = sorted({len(held) for held in rank_slots})
        if len(lengths) > 1:
            raise MoeEpUsageError(
                f"rank_slots must give every rank the same number of slots, got lengths "
                f"{[len(h) for h in rank_slots]}"
            )
        return cls(num_experts, len(rank_slots), flat)

    # -- shape ----------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """W * S."""
        return len(self.slots)

    @property
    def slots_per_rank(self) -> int:
        """S: the experts' weights each rank holds (the weight pack's leading dim)."""
        return len(self.slots) // self.world_size

    @property
    def num_redundant(self) -> int:
        """Slots beyond one per held expert (`W * S - (E - len(masked))`)."""
        return len(self.slots) - self.num_experts + len(self.masked)

    @cached_property
    def is_contiguous(self) -> bool:
        """True for the contiguous layout (the layer then runs its default path)."""
        return not self.masked and self.slots == tuple(range(self.num_experts))

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The logical experts of rank `rank`'s slots, in slot order."""
        if not 0 <= rank < self.world_size:
            raise MoeEpUsageError(f"rank must be in [0, {self.world_size}), got {rank}")
        s = self.slots_per_rank
        return self.slots[rank * s : (rank + 1) * s]

    @cached_property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """Per logical expert, its physical slots in increasing order (replica 0 first;
        none for a masked expert)."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(self.slots):
            out[e].append(p)
        return tuple(tuple(r) for r in out)

    @property
    def replicated(self) -> bool:
        """Whether some expert has more than one copy."""
        return self.num_redundant > 0

    def expected_rank_load(self, load: Sequence[float]) -> list[float]:
        """Per rank, the load its slots would take for per-expert `load` `[E]`, each expert's
        load split evenly over its copies (what the dispatch's spreading does)."""
        if len(load) != self.num_experts:
            raise MoeEpUsageError(
                f"load must have num_experts={self.num_experts} entries, got {len(load)}"
            )
        copies = [len(r) for r in self.replicas]
        out = [0.0] * self.world_size
        for p, e in enumerate(self.slots):
            out[self.rank_of_slot(p)] += float(load[e]) / copies[e]
        return out

    # -- identity -------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_experts": self.num_experts, "world_size": self.world_size,
                               "slots": list(self.slots)}  # fmt: skip
        if self.masked:  # absent otherwise: the digests of unmasked placements stay as they were
            out["masked"] = list(self.masked)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Placement:
        return cls(
            int(data["num_experts"]),
            int(data["world_size"]),
            tuple(data["slots"]),
            tuple(int(x) for x in data.get("masked", ())),
        )

    @cached_property
    def digest(self) -> str:
        """sha256 of the canonical JSON: equal on two ranks iff the placements are equal."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def __repr__(self) -> str:
        # the slots can be thousands of ints: the agreement check and errors print this
        kind = "contiguous" if self.is_contiguous else f"{self.num_redundant} redundant"
        if self.masked:
            kind += f", {len(self.masked)} masked"
        return (
            f"Placement(num_experts={self.num_experts}, world_size={self.world_size}, "
            f"slots_per_rank={self.slots_per_rank}, {kind}, digest={self.digest[:16]})"
        )

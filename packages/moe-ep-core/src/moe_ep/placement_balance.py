"""An EPLB-style balancer: a `Placement` from observed per-expert load (docs/placement.md).

Two steps, as DeepSeek's EPLB: replicate (each redundant slot goes to the expert with the
highest load per copy, lowest id on ties, at most one copy per rank), then pack (the copies,
heaviest per copy first, each onto the least-loaded rank with a free slot that does not hold
that expert yet). Greedy packing can lose to a given split (loads `[3, 3, 0, 2, 2, 2]` on two
ranks of three slots: greedy 7, contiguous 6), so the balancer also builds the placement
that keeps every expert's first copy on its contiguous rank (when E divides by W), and the
contiguous layout whose redundant slots take the copies that leave the heaviest rank
lightest (a replicated hot pair can be worse than a lucky contiguous split), and returns the
candidate with the lowest heaviest rank. Pure Python, deterministic: the same
load gives the same placement on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from moe_ep.errors import MoeEpUsageError
from moe_ep.placement import Placement

__all__ = ["balance_placement", "replica_counts"]

_RankKey = Callable[[int, list[float], list[int]], tuple[float, ...]]


def _check_load(load: Sequence[float]) -> list[float]:
    values = [float(x) for x in load]
    if not values:
        raise MoeEpUsageError("load must name at least one expert, got an empty sequence")
    bad = [(e, v) for e, v in enumerate(values) if not math.isfinite(v) or v < 0]
    if bad:
        e, v = bad[0]
        raise MoeEpUsageError(f"load must be finite and >= 0 per expert: expert {e} has {v}")
    return values


def replica_counts(load: Sequence[float], world_size: int, num_redundant: int) -> list[int]:
    """Copies per expert: each of `num_redundant` extra slots goes to the expert with the
    highest load per copy among those with fewer than `world_size` copies (lowest id wins
    ties)."""
    values = _check_load(load)
    copies = [1] * len(values)
    for _ in range(num_redundant):
        best = max(
            (e for e in range(len(values)) if copies[e] < world_size),
            key=lambda e: (values[e] / copies[e], -e),
        )
        copies[best] += 1
    return copies


def _pack(
    order: list[int],
    copies: list[int],
    per_copy: list[float],
    world_size: int,
    per_rank: int,
    key: _RankKey,
    pinned: dict[int, int],
) -> list[list[int]] | None:
    """Copies of the experts in `order` onto ranks (the rank minimising `key`), after the
    `pinned` first copies; None when some expert finds no free rank not holding it."""
    held: list[list[int]] = [[] for _ in range(world_size)]
    rank_load = [0.0] * world_size
    for e, r in pinned.items():
        held[r].append(e)
        rank_load[r] += per_copy[e]
    for e in order:
        for _ in range(copies[e] - (e in pinned)):
            used = [len(held[r]) for r in range(world_size)]
            ok = [r for r in range(world_size) if used[r] < per_rank and e not in held[r]]
            if not ok:
                return None
            r = min(ok, key=lambda r: key(r, rank_load, used))
            held[r].append(e)
            rank_load[r] += per_copy[e]
    return [sorted(h) for h in held]


def _contiguous_plus(values: list[float], world_size: int, num_redundant: int) -> list[list[int]]:
    """The contiguous layout, each redundant slot (ranks in turn) then taking the copy that
    leaves the heaviest rank lightest (e.g. a cold expert's, which moves no load)."""
    e = len(values)
    per = e // world_size
    held = [list(range(r * per, (r + 1) * per)) for r in range(world_size)]
    ranks_of: list[list[int]] = [[x // per] for x in range(e)]
    loads = [sum(values[r * per : (r + 1) * per]) for r in range(world_size)]

    def after(x: int, r: int) -> list[float]:
        """The rank loads with one more copy of x, on rank r."""
        out = list(loads)
        c = len(ranks_of[x])
        for q in ranks_of[x]:
            out[q] -= values[x] / c - values[x] / (c + 1)
        out[r] += values[x] / (c + 1)
        return out

    for step in range(num_redundant):
        r = step % world_size
        x = min(
            (x for x in range(e) if r not in ranks_of[x]),
            key=lambda x: (max(after(x, r)), after(x, r)[r], x),
        )
        loads = after(x, r)
        ranks_of[x].append(r)
        held[r].append(x)
    return [sorted(h) for h in held]


def balance_placement(load: Sequence[float], world_size: int, num_redundant: int = 0) -> Placement:
    """A placement of `len(load)` experts over `world_size` ranks with `num_redundant`
    extra slots, evening out the per-rank load (each expert's load split evenly over its
    copies).

    Args:
        load: `[E]` observed load per logical expert (e.g. the sum over ranks and forwards of
            `MoEEpLayer.expert_load`); finite, >= 0.
        world_size: W.
        num_redundant: extra slots over all ranks; `E + num_redundant` must divide by W and
            be at most `E * W` (one copy per rank at most).

    Returns the candidate with the lowest heaviest rank (`Placement.expected_rank_load`);
    never heavier than the contiguous layout when `E % W == 0` and `num_redundant == 0`.
    """
    values = _check_load(load)
    e = len(values)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MoeEpUsageError(f"world_size must be an int >= 1, got {world_size!r}")
    if isinstance(num_redundant, bool) or not isinstance(num_redundant, int) or num_redundant < 0:
        raise MoeEpUsageError(f"num_redundant must be an int >= 0, got {num_redundant!r}")
    if (e + num_redundant) % world_size:
        raise MoeEpUsageError(
            f"num_experts + num_redundant must divide by world_size (equal slots per rank): "
            f"got {e} + {num_redundant} for world_size={world_size}"
        )
    if num_redundant > e * (world_size - 1):
        raise MoeEpUsageError(
            f"num_redundant must be at most num_experts * (world_size - 1) = "
            f"{e * (world_size - 1)} (one copy per rank), got {num_redundant}"
        )
    per_rank = (e + num_redundant) // world_size
    copies = replica_counts(values, world_size, num_redundant)
    per_copy = [values[x] / copies[x] for x in range(e)]
    heaviest_first = sorted(range(e), key=lambda x: (-per_copy[x], x))

    def least_loaded(r: int, rank_load: list[float], used: list[int]) -> tuple[float, ...]:
        return (rank_load[r], used[r], r)

    def most_free(r: int, rank_load: list[float], used: list[int]) -> tuple[float, ...]:
        return (used[r], rank_load[r], r)

    candidates = [
        _pack(heaviest_first, copies, per_copy, world_size, per_rank, least_loaded, {}),
        # always completes: experts with more copies first onto the emptiest ranks
        _pack(
            sorted(range(e), key=lambda x: (-copies[x], -per_copy[x], x)),
            copies,
            per_copy,
            world_size,
            per_rank,
            most_free,
            {},
        ),
    ]
    if e % world_size == 0:
        home = {x: x // (e // world_size) for x in range(e)}
        candidates.append(
            _pack(heaviest_first, copies, per_copy, world_size, per_rank, least_loaded, home)
        )
        candidates.append(_contiguous_plus(values, world_size, num_redundant))
    best: Placement | None = None
    best_max = math.inf
    for held in candidates:
        if held is None:
            continue
        placement = Placement.from_rank_slots(e, held)
        heaviest = max(placement.expected_rank_load(values))
        if heaviest < best_max:
            best, best_max = placement, heaviest
    assert best is not None, "the most-free packing always completes"
    return best

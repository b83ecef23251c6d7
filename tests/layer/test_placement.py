"""`Placement`, the balancer, the replica routing rule and the weight slicing (one process)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_ep import FleetParams, MoEWeightPack
from moe_ep.errors import MoeEpUsageError
from moe_ep.placement import Placement
from moe_ep.placement_balance import balance_placement, replica_counts
from moe_ep.placement_routing import expert_pair_counts, replica_table, route_to_slots
from moe_ep.placement_weights import slice_weights, transfer_sources

# -- Placement ----------------------------------------------------------------------------


def test_contiguous_is_the_default_layout() -> None:
    p = Placement.contiguous(8, 2)
    assert p.rank_slots(0) == (0, 1, 2, 3) and p.rank_slots(1) == (4, 5, 6, 7)
    assert p.is_contiguous and not p.replicated and p.slots_per_rank == 4
    # a contiguous placement is stored as None: the fleets (and the agreement) compare equal
    assert FleetParams(8, 16, 64, placement=p) == FleetParams(8, 16, 64)
    assert FleetParams(8, 16, 64, placement=p).placement is None


def test_replicas_digest_and_json() -> None:
    p = Placement.from_rank_slots(4, [[0, 1, 3], [0, 2, 3]])
    assert p.replicas == ((0, 3), (1,), (4,), (2, 5))
    assert p.num_redundant == 2 and p.replicated and not p.is_contiguous
    assert Placement.from_json(p.to_json()) == p
    assert p.digest == Placement(4, 2, (0, 1, 3, 0, 2, 3)).digest
    assert p.digest != Placement(4, 2, (0, 1, 3, 0, 3, 2)).digest
    assert p.expected_rank_load([4.0, 1.0, 1.0, 2.0]) == [2.0 + 1.0 + 1.0, 2.0 + 1.0 + 1.0]
    assert "digest=" in repr(p) and "2 redundant" in repr(p)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 1, (0,)), "num_experts must be an int >= 1, got 0"),
        ((2, 0, (0, 1)), "world_size must be an int >= 1, got 0"),
        ((2, 1, [0, 1]), "slots must be a tuple of ints, got list"),
        ((3, 2, (0, 1, 2)), "world_size \\* slots_per_rank .* got 3 slots for world_size=2"),
        ((2, 1, (0, 2)), "slot 1 holds 2"),
        ((3, 1, (0, 1, 1)), "experts \\[2\\] have none"),
        ((2, 2, (0, 0, 1, 1)), "rank 0 holds expert 0 2 times"),
    ],
)
def test_bad_placements_are_refused_naming_the_rule(args: tuple, match: str) -> None:
    with pytest.raises(MoeEpUsageError, match=match):
        Placement(*args)


def test_fleet_params_checks_its_placement() -> None:
    with pytest.raises(MoeEpUsageError, match=r"placement\.num_experts must equal num_experts=8"):
        FleetParams(8, 16, 64, placement=Placement.contiguous(4, 2))
    with pytest.raises(MoeEpUsageError, match=r"placement must be a moe_ep\.placement\.Placement"):
        FleetParams(8, 16, 64, placement=(0, 1))  # type: ignore[arg-type]
    fleet = FleetParams(4, 16, 64, placement=Placement(4, 2, (0, 1, 3, 0, 2, 3)))
    assert fleet.experts_per_rank(2) == 3
    with pytest.raises(MoeEpUsageError, match=r"placement is for world_size=2.*world_size=4"):
        fleet.experts_per_rank(4)


# -- balancer -----------------------------------------------------------------------------


def test_balancer_keeps_contiguous_where_greedy_packing_loses() -> None:
    # greedy packing puts 3 / 2 / 2 on one rank (7); the contiguous split is 6 / 6
    p = balance_placement([3, 3, 0, 2, 2, 2], 2)
    assert p.slots == (0, 1, 2, 3, 4, 5)


def test_balancer_replicates_the_hottest_and_packs_by_hand() -> None:
    # copies: expert 0 (6) gets the first extra slot (3 per copy), then expert 1 (2 per copy
    # > 1): expert 0 already has a copy on each of the two ranks. Packing, heaviest per copy
    # first: 0 -> r0, 0 -> r1, 1 -> r0 (tie, lower rank), 1 -> r1, 2 -> r0, 3 -> r1: 5 / 5.
    load = [6, 2, 1, 1]
    assert replica_counts(load, 2, 2) == [2, 2, 1, 1]
    p = balance_placement(load, 2, num_redundant=2)
    assert p.slots == (0, 1, 2, 0, 1, 3)
    assert p.expected_rank_load(load) == [5.0, 5.0]
    assert max(Placement.contiguous(4, 2).expected_rank_load(load)) == 8.0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1, 2, 3], 2, 0), "num_experts \\+ num_redundant must divide by world_size"),
        (([1, 2], 2, 4), "num_redundant must be at most num_experts \\* \\(world_size - 1\\) = 2"),
        (([1, -2], 2, 0), "expert 1 has -2.0"),
        (([1, float("nan")], 2, 0), "expert 1 has nan"),
        (([], 2, 0), "at least one expert"),
        (([1, 2], 0, 0), "world_size must be an int >= 1, got 0"),
        (([1, 2], 2, -2), "num_redundant must be an int >= 0, got -2"),
    ],
)
def test_balancer_refuses_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(MoeEpUsageError, match=match):
        balance_placement(*args)


@st.composite
def _loads(draw: st.DrawFn, *, hot_experts: int | None) -> tuple[list[int], int, int]:
    """(load, world size, redundant slots): a base load per expert plus hot experts, all
    of one magnitude (`hot_experts=1`: one) or any number of any magnitude (None)."""
    world = draw(st.sampled_from([1, 2, 4, 8]))
    per_rank = draw(st.integers(1, 6))
    e = world * per_rank
    load = draw(st.lists(st.integers(0, 20), min_size=e, max_size=e))
    if hot_experts is None:
        for x in draw(st.lists(st.integers(0, e - 1), max_size=max(1, e // 4))):
            load[x] += draw(st.integers(0, 4000))
    else:
        load[draw(st.integers(0, e - 1))] += 20 * draw(st.integers(5, 200))
    extra_per_rank = draw(st.integers(0, 3))
    redundant = min(world * extra_per_rank, e * (world - 1))
    return load, world, redundant - redundant % world


def _check_invariants(load: list[int], world: int, redundant: int) -> tuple[float, float]:
    """The placement's invariants; (its heaviest rank, the contiguous layout's)."""
    p = balance_placement(load, world, redundant)
    assert p == balance_placement(load, world, redundant)  # deterministic
    e = len(load)
    assert p.num_experts == e and p.world_size == world
    assert p.num_slots == e + redundant and p.num_slots % world == 0  # equal slots per rank
    assert all(1 <= len(r) <= world for r in p.replicas)  # every expert has a copy
    for r in range(world):  # at most one copy per rank
        assert len(set(p.rank_slots(r))) == p.slots_per_rank
    return max(p.expected_rank_load(load)), max(
        Placement.contiguous(e, world).expected_rank_load(load)
    )


@settings(max_examples=400, deadline=None)
@given(_loads(hot_experts=1))
def test_balancer_is_no_worse_than_contiguous_on_skewed_loads(
    problem: tuple[list[int], int, int],
) -> None:
    load, world, redundant = problem
    balanced, contiguous = _check_invariants(load, world, redundant)
    assert balanced <= contiguous + 1e-9
    hot = max(range(len(load)), key=lambda x: load[x])
    if world > 1 and redundant and load[hot] > sum(load) - load[hot]:
        # the hot expert outweighs all others: split over two ranks, it makes every rank
        # lighter than the contiguous one holding it whole
        assert len(balance_placement(load, world, redundant).replicas[hot]) >= 2
        assert balanced < contiguous


@settings(max_examples=400, deadline=None)
@given(_loads(hot_experts=None))
def test_balancer_invariants_on_any_loads(problem: tuple[list[int], int, int]) -> None:
    load, world, redundant = problem
    balanced, contiguous = _check_invariants(load, world, redundant)
    if redundant == 0:  # the contiguous layout is one of the candidates
        assert balanced <= contiguous + 1e-9


def test_redundant_slots_can_cost_a_perfectly_balanced_contiguous_split() -> None:
    # why the property above needs a skew: contiguous is 104 / 104 here, and every rank's
    # redundant slot must take a copy of a loaded expert of the other rank, which moves load
    load = [101, 1, 1, 1, 100, 0, 0, 4]
    balanced, contiguous = _check_invariants(load, 2, 2)
    assert contiguous == 104 and 104 < balanced <= 104.5


# -- routing ------------------------------------------------------------------------------


def _expected_slots(ids: torch.Tensor, reps: list[list[int]], spread: int, block: int) -> list:
    """The rule written out: number each expert's pairs in global (token, slot) order."""
    total = [int((ids == e).sum()) for e in range(len(reps))]
    seen = [0] * len(reps)
    out = []
    for row in ids.tolist():
        got = []
        for e in row:
            if e < 0:
                got.append(-1)
                continue
            i = seen[e]
            seen[e] += 1
            run = i if total[e] <= spread else i // block
            got.append(reps[e][run % len(reps[e])])
        out.append(got)
    return out


@pytest.mark.parametrize(("spread", "block"), [(1000, 4), (5, 4), (0, 3)])
def test_replica_choice_is_the_same_at_every_world_size(spread: int, block: int) -> None:
    g = torch.Generator().manual_seed(3)
    e, k, n = 6, 3, 40
    ids = torch.randint(0, e, (n, k), generator=g)
    ids[torch.rand(n, k, generator=g) < 0.15] = -1
    ids[::2, 0] = 5  # a hot expert
    reps = [[0], [1, 11], [2], [3, 13, 23], [4], [5, 15, 25]]  # any slot numbering
    most = max(len(r) for r in reps)
    table = (
        torch.tensor([r + [r[0]] * (most - len(r)) for r in reps]),
        torch.tensor([len(r) for r in reps]),
    )
    want = _expected_slots(ids, reps, spread, block)
    for world in (1, 2, 3, 4):
        bounds = [n * r // world for r in range(world + 1)]
        parts = [ids[bounds[r] : bounds[r + 1]] for r in range(world)]
        counts = torch.stack([expert_pair_counts(part, e) for part in parts])
        got = torch.cat(
            [
                route_to_slots(
                    part, table, rank_counts=counts, rank=r, spread_rows=spread, row_block=block
                )
                for r, part in enumerate(parts)
            ]
        )
        assert got.tolist() == want, world


def test_single_copies_route_without_counts() -> None:
    p = Placement(4, 2, (2, 0, 3, 1))  # expert e in slot p.replicas[e][0]
    ids = torch.tensor([[0, 1, -1], [3, 2, 0]])
    got = route_to_slots(
        ids, replica_table(p, torch.device("cpu")), rank_counts=None, rank=0, spread_rows=0,
        row_block=1,
    )  # fmt: skip
    assert got.tolist() == [[1, 3, -1], [2, 0, 1]]


def test_expert_pair_counts_skip_padding_and_count_duplicates() -> None:
    ids = torch.tensor([[1, 1, -1], [0, 3, 1]], dtype=torch.int32)
    assert expert_pair_counts(ids, 5).tolist() == [1, 3, 0, 1, 0]


# -- weights ------------------------------------------------------------------------------


def test_slice_weights_takes_each_slots_expert() -> None:
    e = 4
    w13 = torch.arange(e * 2 * 3, dtype=torch.float32).view(e, 2, 3)
    w2 = torch.arange(e * 3 * 1, dtype=torch.float32).view(e, 3, 1)
    full = MoEWeightPack(w13, w2)
    p = Placement(e, 2, (3, 0, 2, 1, 3, 0))
    rank1 = slice_weights(full, p, 1)
    assert torch.equal(rank1.w13, torch.stack([w13[1], w13[3], w13[0]]))
    assert torch.equal(rank1.w2, torch.stack([w2[1], w2[3], w2[0]]))
    with pytest.raises(MoeEpUsageError, match=r"full\.w13 must hold every expert"):
        slice_weights(MoEWeightPack(w13[:2], w2[:2]), p, 0)


def test_transfer_sources_prefer_the_own_rank() -> None:
    old = Placement(4, 2, (0, 1, 2, 3))
    new = Placement(4, 2, (3, 0, 1, 3, 2, 0))  # rank 0: 3, 0, 1; rank 1: 3, 2, 0
    # rank 0 keeps 0, 1 from its old slots 0, 1 and fetches 3 (old slot 3); rank 1 keeps
    # 3 and 2 (old slots 3, 2) and fetches 0 (old slot 0)
    assert transfer_sources(old, new) == [3, 0, 1, 3, 2, 0]
    with pytest.raises(MoeEpUsageError, match="must keep num_experts and world_size"):
        transfer_sources(old, Placement.contiguous(4, 4))

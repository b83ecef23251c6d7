"""The portable layer under placements: bf16 outputs equal the contiguous layout's to the bit at
EP 1, 2, 4 (fp8 at EP 2), load counts equal the counts of `topk_ids`, GPU kernels refuse."""

from __future__ import annotations

from collections import Counter
from functools import cache
from typing import Any

import pytest
import torch
from layer_cases import Case, from_wire, make_problem, token_split

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEWeightPack
from moe_ep.backends.portable.cpu_fused import KSEQ_ROWS
from moe_ep.backends.portable.experts import ROW_BLOCK, prepack_host_unavailable
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.placement import Placement
from moe_ep.placement_balance import balance_placement
from moe_ep.spawn import spawn_local

pytestmark = pytest.mark.multirank

E = 8
SMALL = Case("pl_small", tokens=48, routing="skewed", pad_frac=0.1, seed=11)
# the hot expert gets more pairs than one GEMM block: its replicas split it in whole blocks
# and each must compute its part the way the whole expert would (`Dispatched.path_rows`)
BIG = Case("pl_big", tokens=2700, routing="skewed", seed=12)
# experts of 13-27 pairs: split over two replicas each holds fewer than the k order's
# threshold (cpu_fused.KSEQ_ROWS), and must still sum in the order of the whole expert
MID = Case("pl_mid", tokens=40, hidden=1024, inter=512, seed=13)  # sums long enough to show
# the same on prepacked weights where this CPU prepacks (on AVX2 CPUs: every expert in the k
# order on the packed copy, whatever its rows)
MID_PACKED = [
    Case("pl_mid_packed", tokens=40, hidden=1024, inter=512, seed=13,
         config=(("cpu_prepacked_weights", True),))
] if prepack_host_unavailable(torch.device("cpu")) is None else []  # fmt: skip
WORLD_SIZES = (1, 2, 4)


def _global_load(case: Case, world_size: int) -> list[int]:
    counts = Counter(x for x in make_problem(case, world_size)["ids"].reshape(-1).tolist())
    return [counts[e] for e in range(E)]


def _placements(case: Case, world_size: int) -> dict[str, Placement]:
    """A permutation, the balancer's placement with one redundant slot per rank, and every
    expert on two ranks (each rank's slots in another order)."""
    out = {"permuted": Placement(E, world_size, tuple(reversed(range(E))))}
    if world_size > 1:
        out["balanced"] = balance_placement(_global_load(case, world_size), world_size, world_size)
        per = 2 * E // world_size
        out["twice"] = Placement.from_rank_slots(
            E, [[(r * E // world_size + 3 * x) % E for x in range(per)] for r in range(world_size)]
        )
    return out


def _jobs(world_size: int) -> list[tuple[str, Case, str, dict[str, Any] | None]]:
    formats = ("bf16", "fp8") if world_size == 2 else ("bf16",)
    jobs = []
    for case in (SMALL, MID, BIG, *MID_PACKED):
        for fmt in formats if case.config == () else ("bf16",):
            jobs.append((f"{case.name}/{fmt}/contiguous", case, fmt, None))
            for name, p in _placements(case, world_size).items():
                jobs.append((f"{case.name}/{fmt}/{name}", case, fmt, p.to_json()))
    return jobs


@cache
def _run(world_size: int) -> dict[str, Any]:
    from placement_cases import placed_worker

    return {
        "jobs": _jobs(world_size),
        "ranks": spawn_local(placed_worker, world_size, _jobs(world_size), timeout_s=600),
    }


def _output(world_size: int, key: str) -> torch.Tensor:
    return torch.cat([from_wire(r[key][0]) for r in _run(world_size)["ranks"]])


def test_the_cases_exercise_replicas_and_whole_blocks() -> None:
    assert _global_load(BIG, 2)[E - 1] > ROW_BLOCK  # the hot expert is split in blocks
    mid = _global_load(MID, 2)
    assert all(KSEQ_ROWS <= c < 2 * KSEQ_ROWS for c in mid), mid  # halves fall below it
    for world in (2, 4):
        for case in (SMALL, BIG):
            p = _placements(case, world)["balanced"]
            assert len(p.replicas[E - 1]) > 1, (case.name, world, p.slots)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_outputs_equal_the_contiguous_layout_to_the_bit(world_size: int) -> None:
    run = _run(world_size)
    checked, failures = 0, []
    for key, _case, _fmt, spec in run["jobs"]:
        if spec is None:
            continue
        base = _output(world_size, key.rsplit("/", 1)[0] + "/contiguous")
        got = _output(world_size, key)
        checked += 1
        if not torch.equal(got, base):
            diff = (got.float() - base.float()).abs()
            failures.append(f"{key} at EP{world_size}: {int((diff > 0).sum())} elements differ")
    assert checked >= (1 if world_size == 1 else 3) * 2
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", (2, 4))
def test_placed_outputs_match_the_oracle(world_size: int) -> None:
    p = make_problem(SMALL, world_size)
    oracle = oracle_forward(p["x"], p["ids"], p["topk_weights"], p["w13"], p["w2"], fmt="bf16")
    report = compare_to_oracle(_output(world_size, "pl_small/bf16/balanced"), oracle)
    assert report.ok, report


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_load_counts_equal_the_counts_of_topk_ids(world_size: int) -> None:
    run = _run(world_size)
    for key, case, _fmt, _spec in run["jobs"]:
        ids = make_problem(case, world_size)["ids"]
        split = token_split(case, world_size)
        for rank, result in enumerate(run["ranks"]):
            lo = sum(split[:rank])
            counts = Counter(ids[lo : lo + split[rank]].reshape(-1).tolist())
            assert result[key][1] == [counts[e] for e in range(E)], (key, rank)


# -- refusals (one process, before any collective) ----------------------------------------


def _pack(experts: int) -> MoEWeightPack:
    return MoEWeightPack(torch.zeros(experts, 256, 128), torch.zeros(experts, 128, 128))


def _refused(match: str, fleet: FleetParams, experts: int, backend: str, **options: Any) -> None:
    """Construction at world size `fleet.placement.world_size` (else 1) raises locally."""
    world = 1 if fleet.placement is None else fleet.placement.world_size
    with pytest.raises(MoeEpUsageError, match=match):
        MoEEpLayer(BootstrapConfig(world, 0), fleet, _pack(experts), backend, **options)


def test_a_gpu_kernel_refuses_a_placement_before_any_collective() -> None:
    fleet = FleetParams(4, 16, 128, placement=Placement(4, 1, (1, 0, 2, 3)))
    _refused(
        "supports only the contiguous expert layout", fleet, 4, "sm90_fp8_fp8_bf16_pull_cutedsl"
    )


def test_load_counting_is_off_by_default_and_takes_a_bool() -> None:
    _refused(
        "count_load must be a bool, got 1", FleetParams(4, 16, 128), 4,
        "any_bf16_bf16_bf16_torch", count_load=1,
    )  # fmt: skip
    with MoEEpLayer(
        BootstrapConfig(1, 0), FleetParams(4, 16, 128), _pack(4), "any_bf16_bf16_bf16_torch"
    ) as layer:
        with pytest.raises(MoeEpUsageError, match="construct the layer with count_load=True"):
            _ = layer.expert_load
        assert layer.placement == Placement.contiguous(4, 1)


def test_a_pack_not_matching_the_placement_is_refused() -> None:
    fleet = FleetParams(4, 16, 128, placement=Placement(4, 2, (0, 1, 3, 0, 2, 3)))
    _refused("the placement's slots per rank = 3 experts", fleet, 2, "any_bf16_bf16_bf16_torch")


def test_the_dispatch_takes_replicas_with_and_only_with_a_replicated_placement() -> None:
    from moe_ep.backends.portable import AllToAllPrepareFinalize
    from moe_ep.backends.portable.all_to_all import Replicas
    from moe_ep.backends.portable.recipes import Bf16Recipe
    from moe_ep.runtime import acquire

    spread = Replicas(16, 2048)
    with pytest.raises(MoeEpUsageError, match=r"Replicas\.row_block must be an int >= 1, got 0"):
        Replicas(16, 0)
    with acquire(BootstrapConfig(1, 0)) as runtime:
        for placement, replicas in ((None, spread), (Placement(4, 1, (1, 0, 2, 3)), spread)):
            with pytest.raises(MoeEpUsageError, match="needed with, and only with"):
                AllToAllPrepareFinalize(
                    Bf16Recipe(), runtime, num_local_experts=4, hidden_size=128,
                    placement=placement, replicas=replicas,
                )  # fmt: skip

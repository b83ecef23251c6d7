"""`MoEEpLayer.evict`: survivors rebuild the EP group and go on serving (docs/placement.md)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from evict_cases import evict_worker
from layer_cases import from_wire

from moe_ep.backends.portable.experts import prepack_layout
from moe_ep.runtime.store_server import serve_store
from moe_ep.spawn import launch_local


def _run(world_size: int, plan: dict[str, Any]) -> dict[int, dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        env = None
        if plan.get("external"):  # this process serves the store: no EP rank hosts it
            server = stack.enter_context(serve_store())
            env = {"MASTER_ADDR": server.host, "MASTER_PORT": str(server.port)}
        run = launch_local(
            evict_worker, world_size, plan, timeout_s=120, failure_grace_s=60, env=env
        )
    dead = plan.get("kill", []) + plan.get("die", []) + plan.get("kill2", [])
    bad = [f for f in run.failures if f.rank not in dead]
    assert not bad, bad
    return run.results


def _survivors(results: dict[int, dict[str, Any]], plan: dict[str, Any]) -> list[dict[str, Any]]:
    gone = set(plan.get("kill", [])) | set(plan.get("stop", [])) | set(plan.get("die", []))
    gone |= set(plan.get("kill2", []))
    return [results[r] for r in sorted(results) if r not in gone]


_KPACK = prepack_layout(torch.device("cpu")) == "k16"
needs_kpack = pytest.mark.skipif(not _KPACK, reason="no k-order packing of bf16 weights here")


@pytest.mark.parametrize(
    ("victim", "packed"), [(1, False), (3, False), pytest.param(1, True, marks=needs_kpack)]
)
def test_replicate_keeps_the_bits_after_losing_a_rank(victim: int, packed: bool) -> None:
    """Also with bf16 weights packed for the k order (the layer holds no pack: the
    eviction rebuilds the kernel on the pack the packed copy gives back)."""
    plan = {"mode": "replicate", "kill": [victim], "packed": packed}
    results = _run(4, plan)
    alive = _survivors(results, plan)
    assert len(alive) == 3
    for i, res in enumerate(alive):
        assert res["held"] == res["held_after"] == (not packed)
        assert res["verdict"]["failed_ranks"] == [victim], res["verdict"]
        assert res["survivors"] == [[r for r in range(4) if r != victim]]
        assert (res["new_rank"], res["new_world"]) == (i, 3)
        assert torch.equal(from_wire(res["after"]), from_wire(res["before"]))
        assert torch.equal(from_wire(res["after2"]), from_wire(res["before"]))
        assert res["warnings"] == []
        assert res["destroy_s"] < 3.0 + 2.0


def test_mask_zeroes_the_lost_experts_without_renormalising() -> None:
    plan = {"mode": "mask", "kill": [2]}
    alive = _survivors(_run(4, plan), plan)
    assert len(alive) == 3
    for res in alive:
        assert res["verdict"]["failed_ranks"] == [2]
        # experts 4, 5 lived on rank 2 only: the output is the one with their weights zeroed
        assert torch.equal(from_wire(res["after"]), from_wire(res["zeroed"]))
        assert not torch.equal(from_wire(res["after"]), from_wire(res["before"]))
        assert len(res["warnings"]) == 1 and "experts [4, 5]" in res["warnings"][0]
        assert "NOT renormalised" in res["warnings"][0]


def test_two_failures_at_once_give_one_verdict_and_mask_goes_on() -> None:
    plan = {"mode": "mask", "kill": [2, 3]}
    alive = _survivors(_run(4, plan), plan)
    assert [r["verdict"]["failed_ranks"] for r in alive] == [[2, 3], [2, 3]]
    assert len({r["verdict"]["error"].split(":")[0] for r in alive}) == 1
    for res in alive:
        assert res["new_world"] == 2
        assert torch.equal(from_wire(res["after"]), from_wire(res["zeroed"]))


def test_replicate_refuses_when_both_copies_are_lost() -> None:
    plan = {"mode": "replicate", "kill": [2, 3]}
    alive = _survivors(_run(4, plan), plan)
    for res in alive:
        assert res["verdict"]["failed_ranks"] == [2, 3]
        (err,) = res["evict_errors"]
        assert err["error"].startswith("MoeEpUsageError") and "experts [6, 7]" in err["error"]


@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=needs_kpack)])
def test_a_failure_during_the_eviction_ends_in_one_verdict(packed: bool) -> None:
    # rank 3 dies in forward 2; rank 2 dies inside the eviction: ranks 0 and 1 agree on
    # [2, 3] (old numbering) and evict again with it (packed: on the pack the first
    # attempt took back from the packed copy before its kernel was destroyed)
    plan = {"mode": "mask", "kill": [3], "die": [2], "die_in_evict": [2], "packed": packed}
    alive = _survivors(_run(4, plan), plan)
    assert len(alive) == 2
    for res in alive:
        assert res["held"] == res["held_after"] == (not packed)
        assert res["verdict"]["failed_ranks"] == [3]
        (err,) = res["evict_errors"]
        assert err["failed_ranks"] == [2, 3], err
        assert res["survivors"] == [[0, 1]] and res["new_world"] == 2
        assert torch.equal(from_wire(res["after"]), from_wire(res["after2"]))
    assert (
        alive[0]["evict_errors"][0]["error"].split(":")[0]
        == alive[1]["evict_errors"][0]["error"].split(":")[0]
    )


def test_an_evicted_rank_that_calls_in_again_is_refused() -> None:
    # rank 0 freezes rank 1 (SIGSTOP) before forward 2, the others time out on it and evict
    # it, then rank 0 resumes it: its forward raises the verdict naming it, and evict refuses
    plan = {"mode": "replicate", "stop": [1]}
    results = _run(4, plan)
    stopped = results[1]
    assert stopped["verdict"]["failed_ranks"] == [1], stopped["verdict"]
    first, second = stopped["rejoin"]
    assert first.startswith("MoeEpUsageError") and "cannot rejoin" in first
    assert second.startswith("MoeEpUsageError") and "must name the ranks" in second
    assert stopped["rejoin_forward"].startswith("MoeEpPeerError")
    for res in _survivors(results, plan):
        assert res["verdict"]["error"].startswith("MoeEpTimeoutError")
        assert res["verdict"]["failed_ranks"] == [1]
        assert torch.equal(from_wire(res["after"]), from_wire(res["before"]))
        assert torch.equal(from_wire(res["after2"]), from_wire(res["before"]))


def test_the_store_host_lost_is_refused_clearly() -> None:
    plan = {"mode": "replicate", "kill": [0]}
    for res in _survivors(_run(4, plan), plan):
        assert res["verdict"]["failed_ranks"] == [0]
        (err,) = res["evict_errors"]
        assert err["error"].startswith("MoeEpUnavailableError")
        assert "store's host (EP rank 0) is among the failed" in err["error"]
        assert "external_store=True" in err["error"] and "serve_store()" in err["error"]


def test_rank_0_lost_with_an_external_store_keeps_the_bits_and_evicts_again() -> None:
    # the store is this process's: rank 0 is an EP rank like any other. After it, old rank
    # 2 (new rank 1) dies too: old ranks 1 and 3 still hold every expert
    plan = {"mode": "replicate", "kill": [0], "external": True, "kill2": [2]}
    results = _run(4, plan)
    alive = _survivors(results, plan)
    assert [r["rank"] for r in alive] == [1, 3]
    for res in alive:
        assert res["verdict"]["failed_ranks"] == [0], res["verdict"]
        assert res["survivors"] == [[1, 2, 3]]
        assert res["new_world"] == 3 and res["new_rank"] == res["rank"] - 1
        assert torch.equal(from_wire(res["after"]), from_wire(res["before"]))
        assert torch.equal(from_wire(res["after2"]), from_wire(res["before"]))
        assert res["verdict2"]["failed_ranks"] == [1], res["verdict2"]  # new numbering
        assert res["survivors2"] == [0, 2]
        assert (res["new_rank2"], res["new_world2"]) == ([1, 3].index(res["rank"]), 2)
        assert torch.equal(from_wire(res["after3"]), from_wire(res["before"]))
        assert res["warnings"] == []
        assert res["destroy_s"] < 3.0 + 2.0
    assert 2 not in results  # it died after the first eviction, as planned


def test_auto_evict_serves_through_losing_rank_0_with_an_external_store() -> None:
    plan = {"mode": "replicate", "kill": [0], "external": True, "auto": True, "kill2": [2]}
    alive = _survivors(_run(4, plan), plan)
    assert [r["rank"] for r in alive] == [1, 3]
    for res in alive:
        assert "verdict" not in res, res["verdict"]
        assert torch.equal(from_wire(res["forward2"]), from_wire(res["before"]))
        assert res["new_world"] == 3
        # old rank 2 (new rank 1) dies next: its experts 4, 5 are on old rank 1 too
        assert "verdict2" not in res, res["verdict2"]
        assert torch.equal(from_wire(res["after3"]), from_wire(res["before"]))
        assert res["new_world2"] == 2


def _layer(**kw: Any) -> Any:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEWeightPack

    w13 = torch.zeros(8, 2 * 32, 64, dtype=torch.bfloat16)
    w2 = torch.zeros(8, 64, 32, dtype=torch.bfloat16)
    return MoEEpLayer(
        BootstrapConfig(1, 0),
        FleetParams(8, 4, 64),
        MoEWeightPack(w13, w2),
        "any_bf16_bf16_bf16_torch",
        **kw,
    )


@pytest.mark.parametrize(
    ("mode", "match"),
    [("bogus", "eviction must be None, 'mask' or 'replicate', got 'bogus'"),
     ("replicate", "at least two ranks: experts \\[0, 1, 2, 3, 4, 5, 6, 7\\]")],
)  # fmt: skip
def test_construction_refuses_a_bad_eviction_mode(mode: str, match: str) -> None:
    from moe_ep import MoeEpUsageError

    with pytest.raises(MoeEpUsageError, match=match):
        _layer(eviction=mode)


def test_evict_is_refused_without_a_mode_or_a_verdict() -> None:
    from moe_ep import MoeEpUsageError

    with _layer() as layer, pytest.raises(MoeEpUsageError, match="eviction='mask'"):
        layer.evict([1])
    with _layer(eviction="mask") as layer:
        with pytest.raises(MoeEpUsageError, match="healthy"):
            layer.evict([1])
        with pytest.raises(MoeEpUsageError, match="sequence of EP ranks"):
            layer.evict("1")  # type: ignore[arg-type]


def test_masked_placement_rules_and_digests() -> None:
    from moe_ep import MoeEpUsageError
    from moe_ep.layer.eviction import survivor_placement
    from moe_ep.placement import Placement

    p = Placement.contiguous(8, 4)
    left = survivor_placement(p, [2], "mask")
    assert left.slots == (0, 1, 2, 3, 6, 7) and left.masked == (4, 5)
    assert left.replicas[4] == () and not left.is_contiguous
    assert Placement.from_json(left.to_json()) == left
    assert "masked" not in p.to_json()  # unmasked digests are unchanged
    with pytest.raises(MoeEpUsageError, match="experts \\[4, 5\\] had every copy"):
        survivor_placement(p, [2], "replicate")
    with pytest.raises(MoeEpUsageError, match="masked and in slots"):
        Placement(8, 1, tuple(range(8)), (3,))
    with pytest.raises(MoeEpUsageError, match="experts \\[5\\] have none"):
        Placement(8, 1, (0, 1, 2, 3, 6, 7, 0, 1)[:6], (4,))


def test_auto_evict_serves_through_a_failure_and_one_inside_the_eviction() -> None:
    # rank 3 dies before forward 2, rank 1 inside the eviction (ranks 0 and 2 still hold
    # every expert): their forward 2 evicts twice on its own and returns forward 1's bits
    plan = {"mode": "replicate", "kill": [3], "die": [1], "die_in_evict": [1], "auto": True}
    alive = _survivors(_run(4, plan), plan)
    assert len(alive) == 2
    for res in alive:
        assert "verdict" not in res, res["verdict"]
        assert torch.equal(from_wire(res["forward2"]), from_wire(res["before"]))
        assert res["new_world"] == 2


def test_auto_evict_needs_a_mode() -> None:
    from moe_ep import MoeEpUsageError

    with pytest.raises(MoeEpUsageError, match="auto_evict must be a bool, and True only"):
        _layer(auto_evict=True)


def test_survivors_that_disagree_on_the_mode_all_refuse_and_stop_serving() -> None:
    plan = {"mode": "replicate", "kill": [3], "mode_of": {1: "mask"}}
    alive = _survivors(_run(4, plan), plan)
    assert len(alive) == 3
    for res in alive:
        (err,) = res["evict_errors"]
        assert err["error"].startswith("MoeEpUsageError") and "different evictions" in err["error"]
        assert "eviction: rank(s) [0, 2] replicate; rank(s) [1] mask" in err["error"]
        assert (
            res["after_refusal"].startswith("MoeEpPeerError") and "broken" in res["after_refusal"]
        )

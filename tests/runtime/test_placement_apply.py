"""`MoEEpLayer.apply_placement` at EP 2 and 4: the digest agreement, the weight move, the
next forwards (equal to the layer's own outputs before, to the bit, and to the oracle), a
rank that disagrees, a rank passing bad input and a rank that never comes."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from moe_ep.backends.portable import experts
from moe_ep.spawn import spawn_local

pytestmark = pytest.mark.multirank

E, H, I, TOKENS, K = 8, 128, 128, 64, 3  # noqa: E741 - I is the glossary name
TIMEOUT_S = 20.0


def _problem() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(TOKENS)])
    ids[::2, 0] = 6  # a hot expert
    ids[ids[:, 1] == 6, 1] = 0
    return {
        "x": torch.randn(TOKENS, H, generator=g).bfloat16(),
        "ids": ids,
        "w": torch.rand(TOKENS, K, generator=g),
        "w13": (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16(),
        "w2": (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16(),
    }


def _wire(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int16).reshape(-1).tolist()


def _apply_worker(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep.errors import MoeEpPeerError
    from moe_ep.placement import Placement
    from moe_ep.placement_balance import balance_placement
    from moe_ep.placement_weights import slice_weights

    torch.set_num_threads(1)
    p = _problem()
    per = TOKENS // world_size
    sl = slice(rank * per, (rank + 1) * per)
    full = MoEWeightPack(p["w13"], p["w2"])
    contiguous = Placement.contiguous(E, world_size)
    packed = mode == "ok packed"  # the layer drops the caller's pack (k-order packing)
    mode = "ok" if packed else mode
    backend: Any = "any_bf16_bf16_bf16_torch"
    if packed:
        from moe_ep.backends.portable.configs import Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig

        backend = Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(cpu_prepacked_weights=True)
    layer = MoEEpLayer(
        BootstrapConfig(
            world_size, rank, timeout_s=TIMEOUT_S if mode not in ("absent", "dies") else 3.0
        ),
        FleetParams(E, per, H),
        slice_weights(full, contiguous, rank),
        backend,
        count_load=True,
    )
    tensors = MoEEpTensors(p["x"][sl], p["ids"][sl], p["w"][sl])
    out: dict[str, Any] = {"before": _wire(layer(tensors)), "holds": []}
    # the host's view: the fleet's load is the sum of every rank's counts
    load = torch.bincount(p["ids"].reshape(-1), minlength=E).tolist()
    balanced = balance_placement(load, world_size, world_size)
    try:
        if mode == "ok":
            steps = {
                "balanced": balanced,
                "twice": Placement.from_rank_slots(
                    E,
                    [
                        [(r * E // world_size + x) % E for x in range(2 * E // world_size)]
                        for r in range(world_size)
                    ],
                ),
                "contiguous": contiguous,
            }
            for name, placement in steps.items():
                layer.apply_placement(placement)
                out[name] = _wire(layer(tensors))
                out["holds"].append(layer._weights is not None)
                pack = layer._weight_pack()
                out[f"{name} pack ok"] = torch.equal(
                    pack.w13, slice_weights(full, placement, rank).w13
                ) and torch.equal(pack.w2, slice_weights(full, placement, rank).w2)
                out[f"{name} placement"] = layer.placement == placement
            out["load"] = layer.expert_load.tolist()
            out["staged_refused"] = None
            staged = layer.stage_inputs(tensors)
            layer.apply_placement(balanced)
            try:
                layer.compute_staged(staged)
            except Exception as exc:
                out["staged_refused"] = f"{type(exc).__name__}: {exc}"
        elif mode == "disagree":
            mine = balanced if rank != world_size - 1 else Placement(
                E, world_size, tuple(reversed(range(E)))
            )  # fmt: skip
            start = time.monotonic()
            try:
                layer.apply_placement(mine)
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            out["seconds"] = time.monotonic() - start
            out["after"] = _wire(layer(tensors))  # still usable, old layout
            out["contiguous kept"] = layer.placement == contiguous
        elif mode == "bad":
            start = time.monotonic()
            try:
                layer.apply_placement(balanced if rank == 0 else "not a placement")  # type: ignore[arg-type]
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
                out["failed_ranks"] = list(getattr(exc, "failed_ranks", []))
            out["seconds"] = time.monotonic() - start
        elif mode == "dies":
            if rank == 1:  # dies in the weight move, after the agreement
                import os

                import moe_ep.layer.weight_moves as moves

                moves._all_to_all = lambda *a, **k: os._exit(17)  # type: ignore[assignment]
            start = time.monotonic()
            try:
                layer.apply_placement(balanced)
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
                out["failed_ranks"] = list(getattr(exc, "failed_ranks", []))
            out["seconds"] = time.monotonic() - start
        elif mode == "absent":
            start = time.monotonic()
            if rank == 0:
                try:
                    layer.apply_placement(balanced)
                except Exception as exc:
                    out["error"] = f"{type(exc).__name__}: {exc}"
                    out["failed_ranks"] = list(getattr(exc, "failed_ranks", []))
            else:
                time.sleep(6.0)  # never calls apply_placement
            out["seconds"] = time.monotonic() - start
        return out
    finally:
        try:
            layer.destroy()
        except MoeEpPeerError:
            if mode == "ok":
                raise


_KPACK = experts.prepack_layout(torch.device("cpu")) == "k16"


@pytest.mark.parametrize(
    ("world_size", "packed"),
    [
        (2, False),
        (4, False),
        pytest.param(
            2,
            True,
            marks=pytest.mark.skipif(
                not _KPACK, reason="no k-order packing of bf16 weights on this CPU"
            ),
        ),
    ],
)
def test_apply_placement_moves_weights_and_keeps_the_bits(world_size: int, packed: bool) -> None:
    """Also on bf16 weights packed for the k order, where the layer holds no pack of its
    own and rebuilds it from the packed copy for each move."""
    from moe_ep.oracle import compare_to_oracle, oracle_forward

    results = spawn_local(_apply_worker, world_size, "ok packed" if packed else "ok", timeout_s=300)
    assert all(r["holds"] == [not packed] * 3 for r in results)
    p = _problem()
    oracle = oracle_forward(p["x"], p["ids"], p["w"], p["w13"], p["w2"], fmt="bf16")
    before = torch.tensor([v for r in results for v in r["before"]]).to(torch.int16)
    assert compare_to_oracle(before.view(torch.bfloat16).view(TOKENS, H), oracle).ok
    for name in ("balanced", "twice", "contiguous"):
        assert all(r[f"{name} pack ok"] and r[f"{name} placement"] for r in results), name
        assert [r[name] for r in results] == [r["before"] for r in results], name
    per = TOKENS // world_size
    for rank, r in enumerate(results):  # 4 forwards: the counts are kept across placements
        mine = p["ids"][rank * per : (rank + 1) * per].reshape(-1)
        assert r["load"] == (4 * torch.bincount(mine, minlength=E)).tolist()
        assert (
            r["staged_refused"] is not None
            and "staged before apply_placement" in (r["staged_refused"])
        )


@pytest.mark.parametrize("world_size", (2, 4))
def test_a_disagreeing_rank_gets_the_same_verdict_everywhere(world_size: int) -> None:
    results = spawn_local(_apply_worker, world_size, "disagree", timeout_s=300)
    last = world_size - 1
    for r in results:
        assert r["error"].startswith("MoeEpUsageError: the EP ranks asked for different placements")
        assert f"rank(s) [{last}]" in r["error"]
        assert f"rank(s) {list(range(last))}" in r["error"]
        assert r["seconds"] < 10.0
        assert r["contiguous kept"] and r["after"] == r["before"]
    texts = {r["error"].split("; every rank raises this)")[1] for r in results}
    assert len(texts) == 1  # the same verdict, beyond the "seen from rank" prefix


def test_a_bad_placement_on_one_rank_fails_its_peer_fast() -> None:
    good, bad = spawn_local(_apply_worker, 2, "bad", timeout_s=120)
    assert bad["error"].startswith("MoeEpUsageError: placement must be a moe_ep.placement")
    assert "MoeEpPeerError" in good["error"] and good["failed_ranks"] == [1]
    assert good["seconds"] < 5.0


def test_a_rank_that_never_comes_times_the_agreement_out() -> None:
    waiting, _absent = spawn_local(_apply_worker, 2, "absent", timeout_s=120)
    assert "MoeEpTimeoutError" in waiting["error"] and waiting["failed_ranks"] == [1]
    assert waiting["seconds"] < 3.0 + 2.5


def test_a_rank_dying_in_the_weight_move_is_named_within_the_timeout() -> None:
    from moe_ep.spawn import launch_local

    run = launch_local(_apply_worker, 2, "dies", timeout_s=120, failure_grace_s=30)
    assert [f.rank for f in run.failures] == [1] and run.failures[0].exitcode == 17
    survivor = run.results[0]
    assert survivor["error"].startswith(("MoeEpPeerError", "MoeEpTimeoutError"))
    assert survivor["failed_ranks"] == [1]
    assert "apply_placement" in survivor["error"]
    assert survivor["seconds"] < 3.0 + 2.5

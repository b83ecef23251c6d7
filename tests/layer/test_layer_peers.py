"""Bad input on one rank raises there before any collective; the others fail fast, no hang.

Design: validation is local (no extra collective per forward). The rank with bad input
raises `MoeEpUsageError` before its first collective and writes its reason into the store;
its peers, blocked in the forward's collective, read it at their next poll and raise
`MoeEpPeerError` naming that rank and the reason (`failed_ranks`, `reasons`) in well
under a second. Bad weights are found before the rank joins the rendezvous, so there is no
store to tell: its peer's bootstrap barrier times out naming it. The bad rank stays alive
here until the peer has failed, so the tests exercise the report / the timeout, not a
closed socket.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_ep.spawn import spawn_local

pytestmark = pytest.mark.multirank

TIMEOUT_S = 4.0
E, H, I = 4, 128, 128  # noqa: E741 - I is the glossary name


def _wait_for(path: Path, limit_s: float) -> None:
    end = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.05)


def _weights(rank: int) -> Any:
    from moe_ep import MoEWeightPack

    g = torch.Generator().manual_seed(rank)
    return MoEWeightPack(
        torch.randn(E // 2, 2 * I, H, generator=g).bfloat16() * 0.1,
        torch.randn(E // 2, H, I, generator=g).bfloat16() * 0.1,
    )


def _forward_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors

    torch.set_num_threads(1)
    layer = MoEEpLayer(
        BootstrapConfig(world_size, rank, timeout_s=TIMEOUT_S),
        FleetParams(E, 8, H),
        _weights(rank),
        "any_bf16_bf16_bf16_torch",
    )
    ids = torch.tensor([[0, 3], [1, 2]])
    if rank == 1:
        ids[1, 0] = 19
    tensors = MoEEpTensors(torch.randn(2, H).bfloat16(), ids, torch.rand(2, 2))
    start = time.monotonic()
    try:
        layer(tensors)
        outcome = ("ok", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - start
    done = Path(tmp) / f"done{rank}"
    done.touch()
    _wait_for(Path(tmp) / f"done{1 - rank}", 3 * TIMEOUT_S)
    if rank == 1:  # keep the bad rank alive until its peer has given up
        _wait_for(Path(tmp) / "done0", 3 * TIMEOUT_S)
    return {"outcome": outcome, "elapsed": elapsed}


def _construct_worker(rank: int, world_size: int) -> dict[str, Any]:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEWeightPack

    w = _weights(rank)
    if rank == 1:
        w = MoEWeightPack(w.w13[:, :-1], w.w2)  # bad shape on rank 1 only
    start = time.monotonic()
    try:
        layer = MoEEpLayer(
            BootstrapConfig(world_size, rank, timeout_s=TIMEOUT_S),
            FleetParams(E, 8, H),
            w,
            "any_bf16_bf16_bf16_torch",
        )
        layer.destroy()
        outcome = ("ok", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    if rank == 1:
        time.sleep(TIMEOUT_S + 2)  # alive but never joining: the peer must time out
    return {"outcome": outcome, "elapsed": time.monotonic() - start}


def test_bad_forward_input_on_one_rank_fails_the_peer_fast(tmp_path: Path) -> None:
    bad, good = reversed(spawn_local(_forward_worker, 2, str(tmp_path), timeout_s=60))
    assert bad["outcome"][0] == "MoeEpUsageError"
    assert "topk_ids has values outside [-1, 4): max=19 at row 1" in bad["outcome"][1]
    assert bad["elapsed"] < 1.0  # raised before any collective
    assert good["outcome"][0] == "MoeEpPeerError", good
    assert "rank(s) [1] failed (rank 1: raised MoeEpUsageError" in good["outcome"][1]
    assert "topk_ids has values outside [-1, 4)" in good["outcome"][1]
    assert "seen from rank 0" in good["outcome"][1]
    assert good["elapsed"] < 1.0  # told through the store, not a timeout


def test_bad_weights_on_one_rank_fail_the_peer_fast() -> None:
    good, bad = spawn_local(_construct_worker, 2, timeout_s=60)
    assert bad["outcome"][0] == "MoeEpUsageError" and "w13 must be" in bad["outcome"][1]
    assert good["outcome"][0] == "MoeEpTimeoutError", good
    assert "rank(s) [1] failed (rank 1: did not arrive within 4 s)" in good["outcome"][1]
    assert good["elapsed"] < TIMEOUT_S + 2 * 1.0 + 1.5  # timeout + 2 x grace + scheduling


def _mismatch_worker(rank: int, world_size: int, what: str) -> dict[str, Any]:
    """Every rank's arguments are valid on their own; rank 1's differ from rank 0's."""
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer
    from moe_ep.backends.portable import Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig as Cfg

    torch.set_num_threads(1)
    tokens = 16 if (what == "fleet" and rank == 1) else 8
    cfg = Cfg(dedup=not (what == "config" and rank == 1))
    start = time.monotonic()
    try:
        layer = MoEEpLayer(
            BootstrapConfig(world_size, rank, timeout_s=TIMEOUT_S),
            FleetParams(E, tokens, H),
            _weights(rank),
            cfg,
        )
        layer.destroy()
        outcome = ("ok", "")
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    return {"outcome": outcome, "elapsed": time.monotonic() - start}


@pytest.mark.parametrize(
    ("what", "field", "rank1_value"),
    [("fleet", "fleet_params", "max_tokens_per_rank=16"), ("config", "config", "dedup=False")],
)
def test_ranks_asking_for_different_layers_all_raise_at_construction(
    what: str, field: str, rank1_value: str
) -> None:
    results = spawn_local(_mismatch_worker, 2, what, timeout_s=60)
    for rank, r in enumerate(results):
        kind, message = r["outcome"]
        assert kind == "MoeEpUsageError", (rank, r)
        assert "the EP ranks asked for different layers" in message
        assert f"{field}: rank(s) [0]" in message and "rank(s) [1]" in message
        assert rank1_value in message
        assert r["elapsed"] < TIMEOUT_S  # a gather, not a timeout

"""`MoEEpTensors.num_valid_tokens_tensor` (flashinfer 0.7.4's live-token count): rows at or
past the count are neither dispatched (the layer's expert load counts only the live pairs)
nor written (the caller's output rows keep their values, a layer-allocated output is zeros
there). Counts from 0 to max_tokens_per_rank, different on every rank, at EP 1, 2 and 4: the
live rows bit-identical to a forward given only them, and within the oracle's band."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from layer_cases import KERNELS, Case, from_wire, make_problem, to_wire

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable.kernel import Bf16TorchKernel
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.spawn import free_port, spawn_local

MAX_T, H, K = 6, 256, 4
WEIGHTS = Case("live_tokens", experts=8, seed=3)
SENTINEL = 7.0
FORMATS = ("bf16", "nvfp4")


def _count(step: int, rank: int) -> int:
    """0..MAX_T over the steps, shifted per rank (every rank a different count per step)."""
    return (step + 2 * rank) % (MAX_T + 1)


def _step_inputs(step: int, rank: int, e: int) -> tuple[torch.Tensor, ...]:
    """MAX_T rows: live rows with some padded slots; rows past the count hold NaN."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(MAX_T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:K] for _ in range(MAX_T)])
    ids[torch.rand(MAX_T, K, generator=g) < 0.2] = -1
    w = torch.rand(MAX_T, K, generator=g)
    x[_count(step, rank) :] = float("nan")  # dispatched, they would poison the sums
    return x, ids, w


def live_worker(rank: int, world_size: int, fmt: str) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    p = make_problem(WEIGHTS, world_size)
    e = WEIGHTS.experts
    el = e // world_size
    layer = MoEEpLayer(
        BootstrapConfig(world_size, rank, timeout_s=60.0),
        FleetParams(e, MAX_T, H),
        MoEWeightPack(p["w13"][rank * el : (rank + 1) * el], p["w2"][rank * el : (rank + 1) * el]),
        KERNELS[fmt],
        count_load=True,
    )
    out = []
    try:
        for step in range(MAX_T + 1 + world_size):
            x, ids, w = _step_inputs(step, rank, e)
            c = _count(step, rank)
            given = None if step % 2 else torch.full((MAX_T, H), SENTINEL, dtype=torch.bfloat16)
            live = torch.tensor([c], dtype=torch.int32)
            layer.reset_expert_load()
            y = layer.forward(MoEEpTensors(x, ids, w, output=given, num_valid_tokens_tensor=live))
            load = layer.expert_load.clone()
            y_live = layer.forward(MoEEpTensors(x[:c], ids[:c], w[:c]))
            out.append(
                {
                    "count": c,
                    "y": to_wire(y),
                    "y_live": to_wire(y_live),
                    "given": given is not None,
                    "same_tensor": given is not None and y.data_ptr() == given.data_ptr(),
                    "load": load.numpy().copy(),
                }
            )
    finally:
        layer.destroy()
    return out


@cache
def _run(world_size: int, fmt: str) -> list[list[dict[str, Any]]]:
    return spawn_local(live_worker, world_size, fmt, timeout_s=600)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", (1, 2, 4))
@pytest.mark.parametrize("fmt", FORMATS)
def test_live_rows_match_a_forward_of_only_them_and_the_oracle(world_size: int, fmt: str) -> None:
    results = _run(world_size, fmt)
    p = make_problem(WEIGHTS, world_size)
    e = WEIGHTS.experts
    counts_seen: set[int] = set()
    for step in range(len(results[0])):
        xs, idss, ws, ys = [], [], [], []
        assert len({results[r][step]["count"] for r in range(world_size)}) == world_size
        for rank in range(world_size):
            r = results[rank][step]
            c = r["count"]
            counts_seen.add(c)
            y = from_wire(r["y"]).view(MAX_T, H)
            assert torch.equal(y[:c], from_wire(r["y_live"]).view(c, H)), (step, rank)
            rest = torch.full((MAX_T - c, H), SENTINEL if r["given"] else 0.0).bfloat16()
            assert torch.equal(y[c:], rest), f"rows past the count written: {step}, {rank}"
            assert r["same_tensor"] == r["given"]
            x, ids, w = _step_inputs(step, rank, e)
            live_ids = ids[:c].reshape(-1)
            want_load = torch.bincount(live_ids[live_ids >= 0], minlength=e)
            assert torch.equal(torch.from_numpy(r["load"]), want_load), "non-live pairs counted"
            xs.append(x[:c])
            idss.append(ids[:c])
            ws.append(w[:c])
            ys.append(y[:c])
        ref = oracle_forward(
            torch.cat(xs), torch.cat(idss), torch.cat(ws), p["w13"], p["w2"], fmt=fmt
        )
        report = compare_to_oracle(torch.cat(ys), ref)
        assert report.ok, f"EP{world_size} {fmt} step {step}: {report}"
    assert counts_seen == set(range(MAX_T + 1))


# -- checks, one rank in this process -----------------------------------------------------
@pytest.fixture(scope="module")
def layer() -> Any:
    p = make_problem(WEIGHTS, 1)
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    built = MoEEpLayer(
        boot, FleetParams(8, MAX_T, H), MoEWeightPack(p["w13"], p["w2"]), KERNELS["bf16"]
    )
    yield built
    built.destroy()


def _with(live: Any, n: int = 4) -> MoEEpTensors:
    x, ids, w = (t[:n] for t in _step_inputs(0, 0, 8))
    return MoEEpTensors(x.nan_to_num(), ids, w, num_valid_tokens_tensor=live)


@pytest.mark.parametrize(
    ("live", "message"),
    [
        (torch.tensor([-1], dtype=torch.int32), r"count in \[0, max_tokens_per_rank = 6\], got -1"),
        (torch.tensor([7], dtype=torch.int32), r"count in \[0, max_tokens_per_rank = 6\], got 7"),
        (torch.tensor([5], dtype=torch.int32), r"holds 5, more than the n = 4 rows"),
        (torch.tensor([2], dtype=torch.int64), r"\(1,\) int32 tensor .* got \(1,\) torch.int64"),
        (torch.tensor(2, dtype=torch.int32), r"\(1,\) int32 tensor .* got \(\) torch.int32"),
        (torch.tensor([2, 2], dtype=torch.int32), r"got \(2,\) torch.int32"),
        (torch.empty(1, dtype=torch.int32, device="meta"), r"device cpu, got .* on meta"),
        (2, r"num_valid_tokens_tensor must be a torch.Tensor or None, got int"),
    ],
)  # fmt: skip
def test_a_bad_count_is_refused(layer: MoEEpLayer, live: Any, message: str) -> None:
    with pytest.raises(MoeEpUsageError, match=message):
        layer.stage_inputs(_with(live))  # local: the check runs before any collective


def test_the_unfinalized_forward_and_kernels_without_it_refuse_a_count(
    layer: MoEEpLayer, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = torch.tensor([2], dtype=torch.int32)
    with pytest.raises(MoeEpUsageError, match=r"must be None for forward_unfinalized"):
        layer.forward_unfinalized(_with(live))
    monkeypatch.setattr(Bf16TorchKernel, "supports_live_tokens", False)
    with pytest.raises(MoeEpUsageError, match=r"does not honour .*num_valid_tokens_tensor"):
        layer.stage_inputs(_with(live))


def test_only_the_portable_kernels_honour_a_count() -> None:
    from moe_ep.backends.portable.kernel import PortableTorchKernel
    from moe_ep.registry import available_kernels, get_kernel

    for info in available_kernels():
        cls = get_kernel(info.name)
        assert cls.supports_live_tokens == issubclass(cls, PortableTorchKernel), info.name
        assert not cls.capturable, info.name  # per instance (capture_safe=True), not per class

"""Capture through `MoEEpLayer.forward` with a capturable kernel (`capture_safe=True`),
simulated on CPU by replacing `moe_ep.layer.layer.stream_capturing` (what the layer asks
`torch.cuda.is_current_stream_capturing()` on CUDA).

- No host read of a device value in the whole layer forward under capture (the layer's
  checks, the live count, load counting, the kernel): the recorder of
  `sync_recorder.recording` finds no syncing op. The control: the same forward with the
  switch off (today's eager path, every check on) is caught reading device values.
- EP 1 and 2 (gloo), live counts 0..max different on every rank, rows past the count NaN:
  the forward under capture equals the eager forward bit for bit (rows past the count too),
  its live rows equal a forward of the live rows (what the eager contract promised before),
  a caller's rows past the count keep their values, an allocated output is zeros there, the
  load counts equal a count of the live pairs made here, and the live rows are within the
  oracle's band (which a planted 2% scale fails).
- Eager forwards of a capturable layer refuse what the default layer refuses and nothing
  more; under capture the value checks are off (ids outside [-1, E) routed nowhere); a
  kernel that is not capturable is still refused under capture, before any host read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from capture_cases import MAX_T, SENTINEL, E, H, K, bf16_layer, live_count, step_inputs
from layer_cases import Case, from_wire, make_problem, to_wire
from sync_recorder import recording

from moe_ep import MoEEpLayer, MoEEpTensors
from moe_ep.errors import MoeEpUsageError
from moe_ep.layer import layer as layer_module
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.spawn import spawn_local

WEIGHTS = Case("layer_capture", experts=E, seed=5)


@contextlib.contextmanager
def simulated_capture() -> Iterator[None]:
    """The layer sees its stream as being captured (absent on the code before the switch
    existed: then the old layer runs as it did, which the recorder catches)."""
    real = getattr(layer_module, "stream_capturing", None)
    setattr(layer_module, "stream_capturing", lambda device: True)  # noqa: B010
    try:
        yield
    finally:
        if real is None:
            delattr(layer_module, "stream_capturing")
        else:
            setattr(layer_module, "stream_capturing", real)  # noqa: B010


def _count(step: int, rank: int) -> int:
    return live_count(step, rank, shift=3)


def _step_inputs(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return step_inputs(step, rank, seed=1000, shift=3, duplicate=(2, 3))


def _layer(world_size: int, rank: int, *, count_load: bool = False, **config: Any) -> MoEEpLayer:
    return bf16_layer(WEIGHTS, world_size, rank, count_load=count_load, **config)


def _sentinel() -> torch.Tensor:
    return torch.full((MAX_T, H), SENTINEL, dtype=torch.bfloat16)


def worker(rank: int, world_size: int, dedup: bool) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    layer = _layer(world_size, rank, count_load=True, capture_safe=True, dedup=dedup)
    out = []
    try:
        for step in range(MAX_T + 1 + world_size):
            x, ids, w = _step_inputs(step, rank)
            c = _count(step, rank)
            live = torch.tensor([c], dtype=torch.int32)
            layer.reset_expert_load()
            with recording() as eager_rec:  # warm-up: eager, the same shapes
                y_eager = layer.forward(
                    MoEEpTensors(x, ids, w, output=_sentinel(), num_valid_tokens_tensor=live)
                )
            load_eager = layer.expert_load.clone()
            layer.reset_expert_load()
            with simulated_capture(), recording() as rec:
                y_cap = layer.forward(
                    MoEEpTensors(x, ids, w, output=_sentinel(), num_valid_tokens_tensor=live)
                )
                load_cap = layer.expert_load.clone()
                y_alloc = layer.forward(MoEEpTensors(x, ids, w, num_valid_tokens_tensor=live))
            y_rows = layer.forward(MoEEpTensors(x[:c], ids[:c], w[:c]))
            out.append(
                {
                    "count": c,
                    "synced": rec.synced,
                    "ops": len(rec.ops),
                    "eager_synced": eager_rec.synced,
                    "y_eager": to_wire(y_eager),
                    "y_cap": to_wire(y_cap),
                    "y_alloc": to_wire(y_alloc),
                    "y_rows": to_wire(y_rows),
                    "load_eager": load_eager.tolist(),
                    "load_cap": load_cap.tolist(),
                }
            )
    finally:
        layer.destroy()
    return out


@cache
def _run(world_size: int, dedup: bool, fused: str) -> list[list[dict[str, Any]]]:
    env = {"MOE_EP_CPU_FUSED": fused}
    return spawn_local(worker, world_size, dedup, timeout_s=600, env=env)


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("world_size", "dedup", "fused"),
    [(1, True, "auto"), (2, True, "auto"), (2, False, "auto"), (1, False, "0")],
)  # MOE_EP_CPU_FUSED=0: the torch code a CUDA rank runs (SwiGLU, combine), recorded too
def test_a_layer_forward_under_capture_reads_nothing_on_the_host_and_equals_eager(
    world_size: int, dedup: bool, fused: str
) -> None:
    results = _run(world_size, dedup, fused)
    p = make_problem(WEIGHTS, world_size)
    counts_seen: set[int] = set()
    for step in range(len(results[0])):
        assert len({results[r][step]["count"] for r in range(world_size)}) == world_size
        xs, idss, ws, got = [], [], [], []
        for rank in range(world_size):
            r = results[rank][step]
            c = r["count"]
            counts_seen.add(c)
            assert r["synced"] == [], f"host reads under capture: {r['synced']}"
            assert r["ops"] > 40  # the recorder saw both forwards
            assert "aten._local_scalar_dense.default" in r["eager_synced"]  # the control
            y_eager = from_wire(r["y_eager"]).view(MAX_T, H)
            y_cap = from_wire(r["y_cap"]).view(MAX_T, H)
            y_alloc = from_wire(r["y_alloc"]).view(MAX_T, H)
            y_rows = from_wire(r["y_rows"]).view(c, H)
            assert torch.equal(y_cap, y_eager), (step, rank)
            assert torch.equal(y_cap[:c], y_rows), (step, rank)
            assert bool((y_cap[c:] == SENTINEL).all()), (step, rank)
            assert torch.equal(y_alloc[:c], y_rows) and not bool(y_alloc[c:].any())
            x, ids, w = _step_inputs(step, rank)
            live_ids = ids[:c]
            want = torch.bincount(live_ids[live_ids >= 0], minlength=E).tolist()
            assert r["load_cap"] == want and r["load_eager"] == want, (step, rank)
            xs.append(x[:c])
            idss.append(live_ids)
            ws.append(w[:c])
            got.append(y_cap[:c])
        ref = oracle_forward(torch.cat(xs), torch.cat(idss), torch.cat(ws), p["w13"], p["w2"])
        rows = torch.cat(got)
        assert compare_to_oracle(rows, ref).ok, f"EP{world_size} step {step}"
        if rows.numel() and bool(rows.abs().max() > 0):
            assert not compare_to_oracle(rows.float().mul(1.02).bfloat16(), ref).ok
    assert counts_seen == set(range(MAX_T + 1))


# -- one rank in this process -------------------------------------------------------------
@pytest.fixture(scope="module")
def layers() -> Iterator[tuple[MoEEpLayer, MoEEpLayer]]:
    """(capturable, default) at EP1; a usage error at world size 1 leaves a layer usable."""
    safe, default = _layer(1, 0, capture_safe=True), _layer(1, 0)
    yield safe, default
    safe.destroy()
    default.destroy()


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MAX_T finite rows with padded slots."""
    g = torch.Generator().manual_seed(7)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(MAX_T)])
    ids[0, 1] = -1
    x = torch.randn(MAX_T, H, generator=g).bfloat16()
    return x, ids, torch.rand(MAX_T, K, generator=g)


def test_the_capture_switch_is_off_on_cpu() -> None:
    assert layer_module.stream_capturing(torch.device("cpu")) is False


def test_a_kernel_that_is_not_capturable_is_still_refused_before_any_host_read(
    layers: tuple[MoEEpLayer, MoEEpLayer],
) -> None:
    _, default = layers
    x, ids, w = _inputs()
    with (
        simulated_capture(),
        recording() as rec,
        pytest.raises(MoeEpUsageError, match=r"cannot be captured in a CUDA graph: its forward"),
    ):
        default.forward(MoEEpTensors(x, ids, w, num_valid_tokens_tensor=torch.tensor([3]).int()))
    assert rec.synced == []


def test_under_capture_on_another_stream_than_the_layers_is_refused(
    layers: tuple[MoEEpLayer, MoEEpLayer], monkeypatch: pytest.MonkeyPatch
) -> None:
    safe, _ = layers
    monkeypatch.setattr(safe, "_stream", SimpleNamespace(cuda_stream=11))
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda device: SimpleNamespace(cuda_stream=12)
    )
    with simulated_capture():
        with pytest.raises(MoeEpUsageError, match=r"stream=11, but the capture records stream 12"):
            safe._check_not_capturing(safe.device)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda d: SimpleNamespace(cuda_stream=11))
        assert safe._check_not_capturing(safe.device) is True
    assert safe._check_not_capturing(safe.device) is False


BAD = [
    ("ids", E, r"topk_ids has values outside \[-1, 8\): max=8 at row 1"),
    ("ids", -2, r"topk_ids has values outside \[-1, 8\): min=-2 at row 1"),
    ("weight", float("nan"), r"topk_weights must be finite: got \[.*nan.*\] at row 1"),
    ("count", -1, r"count in \[0, max_tokens_per_rank = 6\], got -1"),
    ("count", 7, r"count in \[0, max_tokens_per_rank = 6\], got 7"),
    ("rows", 5, r"holds 5, more than the n = 4 rows"),
]


@pytest.mark.parametrize(("what", "value", "message"), BAD, ids=[f"{b[0]}={b[1]}" for b in BAD])
def test_an_eager_forward_of_a_capturable_layer_keeps_every_value_check(
    layers: tuple[MoEEpLayer, MoEEpLayer], what: str, value: float, message: str
) -> None:
    x, ids, w = _inputs()
    live = None
    if what == "ids":
        ids[1, 2] = int(value)
    elif what == "weight":
        w[1, 0] = value
    elif what == "count":
        live = torch.tensor([int(value)], dtype=torch.int32)
    else:
        x, ids, w = x[:4], ids[:4], w[:4]
        live = torch.tensor([int(value)], dtype=torch.int32)
    for layer in layers:
        with pytest.raises(MoeEpUsageError, match=message):
            layer.forward(MoEEpTensors(x, ids, w, num_valid_tokens_tensor=live))


def test_a_capturable_layer_refuses_nothing_new_on_eager(
    layers: tuple[MoEEpLayer, MoEEpLayer],
) -> None:
    """Edge inputs the default layer takes: the capturable one takes them too, and its live
    rows equal its forward of those rows."""
    safe, default = layers
    x, ids, w = _inputs()
    cases = [
        MoEEpTensors(x, ids, w, num_valid_tokens_tensor=torch.tensor([0], dtype=torch.int32)),
        MoEEpTensors(x, ids, w, num_valid_tokens_tensor=torch.tensor([6], dtype=torch.int32)),
        MoEEpTensors(x, torch.full_like(ids, -1), w),
        MoEEpTensors(x, ids.int(), w.bfloat16(), output=_sentinel()),
        MoEEpTensors(x[:0], ids[:0], w[:0]),
    ]
    for t in cases:
        default.forward(t)
        y = safe.forward(t)
        c = t.num_tokens if t.num_valid_tokens_tensor is None else int(t.num_valid_tokens_tensor)
        rows = MoEEpTensors(t.hidden_states[:c], t.topk_ids[:c], t.topk_weights[:c])
        assert torch.equal(y[:c], safe.forward(rows))


def test_under_capture_the_value_checks_are_off(layers: tuple[MoEEpLayer, MoEEpLayer]) -> None:
    """What an eager forward refuses, a captured one routes nowhere (ids outside [-1, E));
    a count past n makes every row live, a negative one none."""
    safe, _ = layers
    x, ids, w = _inputs()
    bad, pad = ids.clone(), ids.clone()
    bad[0, 0], bad[3, 2] = E, -5
    pad[0, 0], pad[3, 2] = -1, -1
    with simulated_capture():
        got = safe.forward(MoEEpTensors(x, bad, w))
        over = safe.forward(
            MoEEpTensors(x, ids, w, num_valid_tokens_tensor=torch.tensor([9], dtype=torch.int32))
        )
        under = safe.forward(
            MoEEpTensors(x, ids, w, num_valid_tokens_tensor=torch.tensor([-3], dtype=torch.int32))
        )
    assert torch.equal(got, safe.forward(MoEEpTensors(x, pad, w)))
    assert torch.equal(over, safe.forward(MoEEpTensors(x, ids, w)))
    assert not bool(under.any())
    with simulated_capture(), pytest.raises(MoeEpUsageError, match=r"\(1,\) int32 tensor"):
        safe.forward(MoEEpTensors(x, ids, w, num_valid_tokens_tensor=torch.tensor([2])))


def test_masked_experts_are_routed_nowhere_with_no_host_read(
    layers: tuple[MoEEpLayer, MoEEpLayer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mask-mode eviction's masked experts (set directly: that mode's placements are not
    contiguous, which capture_safe refuses) read nothing on the host either."""
    x, ids, w = _inputs()
    masked = torch.tensor([2, 5])
    want_ids = torch.where((ids == 2) | (ids == 5), -1, ids)
    assert not torch.equal(want_ids, ids)
    for layer in layers:
        want = layer.forward(MoEEpTensors(x, want_ids, w))
        assert not torch.equal(want, layer.forward(MoEEpTensors(x, ids, w)))
        monkeypatch.setattr(layer, "_masked", masked)
        assert torch.equal(layer.forward(MoEEpTensors(x, ids, w)), want)
        monkeypatch.setattr(layer, "_masked", None)
    safe, _ = layers
    monkeypatch.setattr(safe, "_masked", masked)
    with simulated_capture(), recording() as rec:
        got = safe.forward(MoEEpTensors(x, ids, w))
    assert rec.synced == []
    assert torch.equal(got, safe.forward(MoEEpTensors(x, want_ids, w)))


def test_device_pair_counts_match_the_host_count_and_mask_rows_past_the_count() -> None:
    ids = torch.tensor([[0, 3, -1], [3, 3, 9], [1, -7, 0], [2, 2, 2]])
    counts = layer_module.device_pair_counts(ids, 4, None)
    assert counts.tolist() == [2, 1, 3, 3]  # 9 and -7: outside [0, 4), not counted
    assert layer_module.device_pair_counts(ids, 4, torch.tensor([2])).tolist() == [1, 0, 0, 3]
    assert layer_module.device_pair_counts(ids, 4, torch.tensor([0])).tolist() == [0, 0, 0, 0]
    with recording() as rec:
        layer_module.device_pair_counts(ids, 4, torch.tensor([3], dtype=torch.int32))
    assert rec.synced == []

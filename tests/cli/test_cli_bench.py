"""`moe-ep bench`: a tiny bench end to end (EP1 and EP2, spawned ranks) writes a table, a
JSON document of the stated schema and a PNG; the merge, traffic and ratio arithmetic
against hand-computed values; bad options are usage errors naming the option."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from moe_ep.bench.harness import RankRow, stricter_limits, traffic
from moe_ep.bench.results import SCHEMA, BenchRow, merge
from moe_ep.bench.runner import BenchRequest, check_request
from moe_ep.bench.shapes import BenchShape, deepseek_like, parse_shape
from moe_ep.bench.targets import (
    PEER_OVER_LAYER_DECODE,
    VS_DENSE_PREFILL,
    VS_LIMIT,
    layer_targets,
)
from moe_ep.cli import EXIT_OK, EXIT_USAGE, main
from moe_ep.errors import MoeEpUsageError

KERNEL = "any_bf16_bf16_bf16_torch"
TINY = BenchShape("tiny", 16, 64, 32, 4, 2)


@pytest.mark.multirank
def test_tiny_bench_end_to_end_writes_table_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    argv = ["bench", "--only-shapes", "--shape", "8,64,32,4,2", "--shape", "16,64,32,4,2"]
    argv += ["--ep", "1", "2", "--kernel", KERNEL, "--reps", "2", "--no-peers"]
    argv += ["--json", str(out), "--plot-dir", str(tmp_path)]
    assert main(argv) == EXIT_OK
    text = capsys.readouterr()
    assert "moe-ep bench" in text.out and "status" in text.out and KERNEL[:20] in text.out
    assert "[1/" in text.err  # progress, plain lines off a terminal
    doc = json.loads(out.read_text())
    assert doc["schema"] == SCHEMA and doc["timing"] == "wall time" and doc["reps"] == 2
    machine = doc["machine"]
    for key in ("cpu", "flags", "logical_cpus", "torch_version", "threads"):
        assert key in machine
    assert machine["torch_version"] == torch.__version__
    assert set(doc["read_bandwidth_bytes_per_s"]) == {"1", "2"}
    rows = doc["rows"]
    # 2 shapes x 2 world sizes x 2 routings x 1 kernel, in run order
    assert len(rows) == 8
    assert [(r["world_size"], r["shape"]["T"], r["routing"]) for r in rows[:2]] == [
        (1, 8, "uniform"),
        (1, 8, "skewed"),
    ]
    for r in rows:
        assert r["kernel"] == KERNEL and r["skipped"] is None and len(r["runs_s"]) == 2
        assert r["median_s"] == pytest.approx(
            sorted(r["runs_s"])[0] / 2 + sorted(r["runs_s"])[1] / 2
        )
        tokens = r["shape"]["T"] * r["world_size"]
        assert r["tokens_per_s"] == pytest.approx(tokens / r["median_s"])
        flops = 6 * r["shape"]["T"] * 2 * 64 * 32  # per rank: its tokens' k pairs
        assert r["useful_tflops_per_rank"] == pytest.approx(flops / r["median_s"] / 1e12)
        assert r["limits_s"]["bandwidth"] > 0 and r["limits_s"]["dense fp32"] > 0
        assert ("all_to_all" in r["limits_s"]) == (r["world_size"] == 2)
        assert ("naive" in r["limits_s"]) == (r["world_size"] == 1)
        assert r["ratios"]["vs_dense"] == pytest.approx(
            r["median_s"] / min(r["limits_s"]["dense bf16"], r["limits_s"]["dense fp32"])
        )
    pngs = sorted(tmp_path.glob("bench_*.png"))
    assert len(pngs) == 1 and pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_absent_peer_is_skipped_with_its_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from moe_ep.bench import hf_peer

    monkeypatch.setattr(hf_peer, "unavailable", lambda: "planted: transformers missing")
    out = tmp_path / "bench.json"
    argv = ["bench", "--only-shapes", "--shape", "8,64,32,4,2", "--ep", "1", "--kernel", KERNEL]
    argv += ["--routing", "uniform", "--reps", "1", "--json", str(out), "--no-plot"]
    assert main(argv) == EXIT_OK
    assert "transformers peer skipped: planted: transformers missing" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert "peer" not in row["limits_s"]
    assert row["limit_notes"]["peer"] == "planted: transformers missing"


def test_merge_takes_the_slowest_rank_of_each_run_and_of_each_limit() -> None:
    a = RankRow(TINY, "uniform", KERNEL, [1.0, 5.0, 2.0], limits={"dense bf16": 1.0})
    b = RankRow(TINY, "uniform", KERNEL, [3.0, 1.0, 1.0], limits={"dense bf16": 2.0})
    (row,) = merge(2, [[a], [b]])
    assert row.runs == [3.0, 5.0, 2.0] and row.median == 3.0
    assert row.limits == {"dense bf16": 2.0}
    skipped = RankRow(TINY, "uniform", KERNEL, skipped="no GPU")
    assert merge(1, [[skipped]])[0].status() == "skipped"


def test_traffic_counts_pairs_active_experts_and_rows_sent() -> None:
    # 2 ranks, 4 experts (2 per rank); rank 0's tokens: [0, 1] (both local), [1, 2]
    # (local + rank 1); rank 1's tokens: [3, 2] (local twice), [0, 3]
    ids = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 2], [0, 3]])]
    t0, t1 = traffic(ids, 0, 2), traffic(ids, 1, 2)
    assert (t0.pairs, t0.active, t0.token_rows_sent) == (4, 2, 3)  # 0,1,1 + 0; rows: 2 + 1
    assert (t1.pairs, t1.active, t1.token_rows_sent) == (4, 2, 3)  # 2 + 3,2 + 3
    assert t0.pair_rows_returned == t0.pairs


def test_ratios_against_hand_computed_values() -> None:
    row = BenchRow(
        TINY, 2, "uniform", KERNEL, [2.0, 4.0, 3.0],
        {"dense bf16": 1.5, "dense fp32": 1.0, "bandwidth": 0.5, "all_to_all": 6.0,
         "hf eager": 9.0, "hf grouped_mm": 4.5},
        {},
    )  # fmt: skip
    r = row.ratios()
    assert r == {
        "vs_dense": 3.0,
        "vs_bandwidth": 6.0,
        "vs_all_to_all": 0.5,
        "naive_over_layer": None,
        "peer_over_layer": 1.5,
    }
    assert row.peer() == ("hf grouped_mm", 4.5)
    assert row.tokens_per_s() == 16 * 2 / 3.0
    assert math.isclose(row.tflops() or 0, 6 * 16 * 2 * 64 * 32 / 3.0 / 1e12)  # per rank
    row.targets = {"vs_bandwidth": VS_LIMIT}
    # the dense GEMMs (1.0 s) miss the 1.5x limit target too (2x the 0.5 s limit): noted
    assert row.status() == "over target: vs_bandwidth (dense GEMMs too: 2.00x)"
    row.limits["dense fp32"] = 0.7  # 1.4x the limit: the layer's own miss, no note
    assert row.status() == "over target: vs_bandwidth"
    # the peer (4.5 s) 1.5x as slow as the layer, 9x its 0.5 s limit: 2x is the layer's miss
    row.targets = {"peer_over_layer": PEER_OVER_LAYER_DECODE}
    assert row.status() == "under target: peer_over_layer"
    row.limits["bandwidth"] = 3.0  # now the peer is 1.5x the limit: 2x faster is impossible
    assert row.status() == "under target: peer_over_layer (even at the bandwidth limit: 1.50x)"


def test_targets_apply_at_ep1_uniform_on_the_shapes_the_runbook_names() -> None:
    decode, prefill = (64, 2048, 1024, 64, 8), (4096, 2048, 1024, 16, 4)
    assert layer_targets(decode, "bf16", 1, "uniform")["vs_bandwidth"] == VS_LIMIT
    assert layer_targets(prefill, "bf16", 1, "uniform")["vs_dense"] == VS_DENSE_PREFILL
    assert "vs_bandwidth" not in layer_targets(prefill, "bf16", 1, "uniform")
    assert layer_targets(decode, "bf16", 2, "uniform") == {}
    assert layer_targets(decode, "bf16", 1, "skewed") == {}
    assert set(layer_targets(decode, "nvfp4", 1, "uniform")) == {"vs_bandwidth"}


@pytest.mark.parametrize(
    ("text", "rule"),
    [("1,2,3", "five integers"), ("8,64,32,4,x", "five integers"), ("8,64,32,2,4", "k <= E")],
)
def test_bad_shape_is_a_usage_error_naming_the_option(text: str, rule: str) -> None:
    with pytest.raises(MoeEpUsageError, match=rf"--shape.*{rule}.*{text}"):
        parse_shape(text)


@pytest.mark.parametrize(
    ("gib", "family", "inter"),
    [
        (None, "DeepSeek-like I/8", 256),  # memory unknown: as on a 24 GiB box
        (22.4, "DeepSeek-like I/8", 256),  # this box: 2.6 GiB of bf16 weights
        (8, "DeepSeek-like I/32", 64),
        (64, "DeepSeek-like I/4", 512),
        (200, "DeepSeek-like", 2048),  # the whole model's 21 GiB
        (0.01, "DeepSeek-like I/64", 32),
    ],
)
def test_the_deepseek_like_shape_is_scaled_to_the_memory(
    gib: float | None, family: str, inter: int
) -> None:
    # 8 bytes per weight at the peak within half the memory: 3*H*I*E*8 <= gib/2
    shapes = deepseek_like(None if gib is None else int(gib * 2**30))
    assert [(s.family, s.tokens, s.hidden, s.inter, s.experts, s.topk) for s in shapes] == [
        (family, t, 7168, inter, 256, 8) for t in (16, 64)
    ]


def test_bad_requests_are_refused_before_any_rank_starts() -> None:
    ok = BenchRequest((TINY,), (1,), ("uniform",), (KERNEL,))
    check_request(ok)
    for bad, match in (
        (BenchRequest((TINY,), (1,), ("uniform",), ("no_such_kernel",)), "--kernel.*unknown"),
        (BenchRequest((TINY,), (3,), ("uniform",), (KERNEL,)), "--ep 3.*divisible"),
        (BenchRequest((TINY,), (1,), ("zipf",), (KERNEL,)), "--routing.*'zipf'"),
        (BenchRequest((TINY,), (1,), ("uniform",), (KERNEL,), reps=0), "--reps must be >= 1"),
    ):
        with pytest.raises(MoeEpUsageError, match=match):
            check_request(bad)


def test_cli_bad_shape_exits_2_with_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--shape", "8,64"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "moe-ep: error: --shape must be T,H,I,E,k" in err and "Traceback" not in err


@pytest.mark.slow
@pytest.mark.multirank
def test_quick_bench_covers_every_kernel_and_fits_two_minutes_on_a_quiet_machine(
    tmp_path: Path,
) -> None:
    import os
    import time

    from moe_ep.bench.runner import available_kernels
    from moe_ep.bench.shapes import QUICK_SHAPES

    load = os.getloadavg()[0]
    out = tmp_path / "quick.json"
    start = time.monotonic()
    argv = ["bench", "--quick", "--json", str(out), "--plot-dir", str(tmp_path)]
    assert main(argv) == EXIT_OK
    elapsed = time.monotonic() - start
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(QUICK_SHAPES) * 2 * len(available_kernels())  # EP 1, 2; uniform
    assert {r["routing"] for r in rows} == {"uniform"}
    assert len(list(tmp_path.glob("bench_*.png"))) == len(QUICK_SHAPES)
    if load < 1.0:  # the two-minute bound is stated for a quiet machine only
        assert elapsed < 120, f"--quick took {elapsed:.0f} s at load {load:.2f}"


def test_the_bandwidth_limit_takes_the_faster_of_the_two_reads() -> None:
    def rows() -> list[RankRow]:
        return [RankRow(TINY, "uniform", KERNEL, limits={"bandwidth": 0.4, "dense fp32": 1.0}),
                RankRow(TINY, "uniform", KERNEL, skipped="no kernel")]  # fmt: skip

    # the read after the timings was twice as fast: every bandwidth limit halves
    slower_first = rows()
    assert stricter_limits(slower_first, 10e9, 20e9) == 20e9
    assert slower_first[0].limits == {"bandwidth": 0.2, "dense fp32": 1.0}
    assert slower_first[1].limits == {}
    # the first read was the faster one: the limits stay as measured
    faster_first = rows()
    assert stricter_limits(faster_first, 20e9, 10e9) == 20e9
    assert faster_first[0].limits["bandwidth"] == 0.4

"""`benchlib.moe_peers` and `moe_ep.bench.targets.with_bound_note`: the peers table's ratios
and the notes that say when a target is beyond the dense GEMMs of equal FLOPs or the
bandwidth limit on the machine."""

from __future__ import annotations

import io
from pathlib import Path

from benchlib import moe_peers
from rich.console import Console

from moe_ep.bench import hf_peer
from moe_ep.bench.targets import (
    AT_LIMIT,
    DENSE_TOO,
    PEER_OVER_LAYER_DECODE,
    VS_LIMIT,
    with_bound_note,
)
from moe_ep.bench.timing import Samples


def _result(
    layer_ms: float, dense_ms: float, fp32_ms: float, limit_ms: float
) -> moe_peers.ShapeResult:
    ms = 1e-3
    times = {
        "layer": Samples([layer_ms * ms]),
        "dense": Samples([dense_ms * ms]),
        "dense fp32": Samples([fp32_ms * ms]),
        "naive": Samples([4 * layer_ms * ms]),
    }
    shape = moe_peers.PEER_SHAPES[moe_peers.DECODE_TARGETED]
    skipped = {f"hf {i}": "not timed here" for i in hf_peer.IMPLEMENTATIONS}
    return moe_peers.ShapeResult(moe_peers.DECODE_TARGETED, shape, times, limit_ms * ms, skipped)


def test_dense_vs_limit_takes_the_faster_dense_gemm() -> None:
    (row,) = moe_peers.peer_rows([_result(100.0, 300.0, 48.0, 24.0)])
    assert row["dense_vs_limit"] == 48.0 / 24.0
    assert row["vs_limit"] == 100.0 / 24.0


def test_the_note_only_where_both_miss_the_limit() -> None:
    over = "over target: vs_limit"
    # the layer misses, the dense GEMMs reach the bound: the layer's own miss, no note
    assert with_bound_note(over, VS_LIMIT, 4.3, 1.2, DENSE_TOO) == over
    # both miss: noted with the dense GEMMs' ratio in the target's unit
    assert (
        with_bound_note(over, VS_LIMIT, 4.3, 2.01, DENSE_TOO) == f"{over} (dense GEMMs too: 2.01x)"
    )
    # the layer meets it, or no target on this shape: unchanged
    assert with_bound_note("ok", VS_LIMIT, 1.4, 2.0, DENSE_TOO) == "ok"
    assert with_bound_note("ok", None, 9.0, 9.0, DENSE_TOO) == "ok"
    # exactly on the bound counts as met (<=), for the dense GEMMs as for the layer
    assert with_bound_note(over, VS_LIMIT, 1.6, 1.5, DENSE_TOO) == over


def test_a_peer_target_past_the_bandwidth_limit_is_noted() -> None:
    under = "under target: peer_over_layer"
    # peer 1.8x the limit: 2x faster than the peer would put the layer under its limit
    got = with_bound_note(under, PEER_OVER_LAYER_DECODE, 1.5, 1.8, AT_LIMIT)
    assert got == f"{under} (even at the bandwidth limit: 1.80x)"
    # peer 3x the limit: 2x faster is possible, the miss is the layer's own
    assert with_bound_note(under, PEER_OVER_LAYER_DECODE, 1.5, 3.0, AT_LIMIT) == under


def test_the_printed_table_carries_the_column_and_the_note() -> None:
    buf = io.StringIO()
    out = Console(file=buf, width=400)
    moe_peers.print_peers(out, [_result(100.0, 300.0, 48.0, 24.0)], [], 33e9, "test machine", 1)
    text = buf.getvalue()
    assert "dense/limit" in text
    assert "2.00x" in text  # 48 / 24
    assert "(dense GEMMs too: 2.00x)" in text
    assert "even at the bandwidth limit" not in text  # no peer timed


def test_the_table_notes_a_peer_that_runs_near_the_limit() -> None:
    r = _result(30.0, 300.0, 20.0, 24.0)  # the layer 1.25x its limit, dense under it
    r.skipped.pop("hf grouped_mm")
    r.times["hf grouped_mm"] = Samples([0.040])  # 1.67x the limit: 2x faster is impossible
    buf = io.StringIO()
    moe_peers.print_peers(Console(file=buf, width=400), [r], [], 33e9, "test machine", 1)
    assert "under target: peer_over_layer (even at the bandwidth limit: 1.67x)" in buf.getvalue()


def test_the_plot_marks_the_dense_gemms_over_the_limit(tmp_path: Path) -> None:
    r = _result(100.0, 300.0, 48.0, 24.0)
    q = moe_peers.QuantResult("fp8", Samples([0.14]), 0.012, 400 << 20)
    seen: list[list[float]] = []
    real = moe_peers._dense_marks

    def spy(ax: object, values: list[float]) -> None:
        seen.append(values)
        real(ax, values)

    moe_peers._dense_marks = spy  # type: ignore[assignment]
    try:
        path = moe_peers.plot_peers([r], [q], [], "test", "test machine", tmp_path / "p.png")
    finally:
        moe_peers._dense_marks = real  # type: ignore[assignment]
    assert path.is_file() and path.stat().st_size > 0
    assert seen == [[48.0 / 24.0], [0.048 / 0.012]]  # bf16 vs its limit, fp8 vs its own


def _point(fmt: str, gemm: float, mm: float, **prepacked: float) -> moe_peers.CrossoverPoint:
    kw = {name: Samples([t]) for name, t in prepacked.items()}
    return moe_peers.CrossoverPoint(fmt, 8, Samples([gemm]), Samples([mm]), **kw)


def test_the_crossover_table_prints_the_prepacked_expert_gemm() -> None:
    """With the k-order packing (`gemm_prepacked`): its time and mm / it, blank cells for a
    format without it; with oneDNN's (`mm_prepacked`): it over the expert GEMM."""
    buf = io.StringIO()
    points = [_point("bf16", 0.010, 0.040, gemm_prepacked=0.005), _point("mxfp8", 0.010, 0.020)]
    moe_peers.print_crossover(Console(file=buf, width=400), points, "test machine")
    lines = {
        line.split("│")[1].strip(): line for line in buf.getvalue().splitlines() if "│" in line
    }
    assert "mm / prepacked GEMM" in buf.getvalue()
    cells = [c.strip() for c in lines["bf16"].split("│")[5:8]]
    assert cells[0] == "4.00x" and cells[1].startswith("5.00 (") and cells[2] == "8.00x"
    assert [c.strip() for c in lines["mxfp8"].split("│")[6:8]] == ["", ""]
    buf = io.StringIO()
    moe_peers.print_crossover(
        Console(file=buf, width=400), [_point("bf16", 0.010, 0.040, mm_prepacked=0.02)], "m"
    )
    assert "prepacked / expert GEMM" in buf.getvalue() and "2.00x" in buf.getvalue()


def test_a_crossover_only_plot_says_the_peers_did_not_run(tmp_path: Path) -> None:
    texts: list[str] = []
    real = moe_peers._not_run

    def spy(ax: object, section: str) -> None:
        texts.append(section)
        real(ax, section)

    moe_peers._not_run = spy  # type: ignore[assignment]
    try:
        points = [_point("bf16", 0.01, 0.04), _point("mxfp8", 0.01, 0.02)]
        path = moe_peers.plot_peers([], [], points, "test", "test machine", tmp_path / "p.png")
    finally:
        moe_peers._not_run = real  # type: ignore[assignment]
    assert path.is_file() and texts == ["peers"] * 4


def test_the_quantized_table_prints_the_unpacked_layer() -> None:
    """With --cpu-prepacked-weights, a format whose default packs its weights is timed with
    `cpu_prepacked_weights=False` too: its time and unpacked / layer; a blank cell for a
    format without it (fp8)."""
    r = _result(100.0, 300.0, 48.0, 24.0)
    quant = [
        moe_peers.QuantResult("mxfp8", Samples([0.05]), 0.012, 400 << 20, unpacked=Samples([0.11])),
        moe_peers.QuantResult("fp8", Samples([0.14]), 0.012, 400 << 20),
    ]
    buf = io.StringIO()
    moe_peers.print_peers(Console(file=buf, width=400), [r], quant, 33e9, "test machine", 1)
    text = buf.getvalue()
    assert "layer unpacked" in text and "unpacked/layer" in text
    mxfp8 = next(line for line in text.splitlines() if "mxfp8" in line)
    assert "110.0" in mxfp8 and "2.20x" in mxfp8
    fp8 = next(line for line in text.splitlines() if "│ fp8 " in line)
    assert "140.0" in fp8 and "2.20x" not in fp8

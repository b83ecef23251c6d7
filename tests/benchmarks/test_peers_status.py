"""`benchlib.moe_peers` and `moe_ep.bench.targets.with_dense_note`: the peers table's ratios
and the note that says when a bandwidth-limit target is missed by the dense GEMMs of equal
FLOPs too."""

from __future__ import annotations

import io
from pathlib import Path

from benchlib import moe_peers
from rich.console import Console

from moe_ep.bench import hf_peer
from moe_ep.bench.targets import VS_LIMIT, with_dense_note
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
    assert with_dense_note(over, VS_LIMIT, 4.3, 1.2) == over
    # both miss: noted with the dense GEMMs' ratio in the target's unit
    assert with_dense_note(over, VS_LIMIT, 4.3, 2.01) == f"{over} (dense GEMMs too: 2.01x)"
    # the layer meets it, or no limit target on this shape: unchanged
    assert with_dense_note("ok", VS_LIMIT, 1.4, 2.0) == "ok"
    assert with_dense_note("ok", None, 9.0, 9.0) == "ok"
    # exactly on the bound counts as met (<=), for the dense GEMMs as for the layer
    assert with_dense_note(over, VS_LIMIT, 1.6, 1.5) == over


def test_the_printed_table_carries_the_column_and_the_note() -> None:
    buf = io.StringIO()
    out = Console(file=buf, width=400)
    moe_peers.print_peers(out, [_result(100.0, 300.0, 48.0, 24.0)], [], 33e9, "test machine", 1)
    text = buf.getvalue()
    assert "dense/limit" in text
    assert "2.00x" in text  # 48 / 24
    assert "(dense GEMMs too: 2.00x)" in text


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

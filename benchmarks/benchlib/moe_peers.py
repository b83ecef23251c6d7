"""The issue-16 comparison for `layer_speed.py --sections peers crossover`: the portable layer
against the machine's read bandwidth, dense GEMMs, the naive loop and transformers' experts
on the same weights and routing, and the crossover of the CPU expert GEMM of few rows."""

from __future__ import annotations

import ctypes
import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from rich.console import Console

from benchlib.baseline_kernel import with_library
from benchlib.options import shape_text
from moe_ep import MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable import experts, recipes
from moe_ep.backends.portable.comm import Workspace
from moe_ep.bench import hf_peer as hf_moe
from moe_ep.bench import plots, targets
from moe_ep.bench.limits import dense_gemms, read_bandwidth
from moe_ep.bench.tables import titled_table
from moe_ep.bench.targets import (
    AT_LIMIT,
    DENSE_TOO,
    Target,
    row_status,
    status,
    with_bound_note,
)
from moe_ep.bench.timing import Samples, round_robin

Shape = dict[str, int]
PEER_SHAPES: dict[str, Shape] = {
    "prefill": {"T": 4096, "H": 2048, "I": 1024, "E": 16, "k": 4},
    "T=512": {"T": 512, "H": 2048, "I": 768, "E": 64, "k": 8},
    "decode T=64": {"T": 64, "H": 2048, "I": 1024, "E": 64, "k": 8},
    "decode T=16": {"T": 16, "H": 2048, "I": 1024, "E": 64, "k": 8},
    "decode T=4": {"T": 4, "H": 2048, "I": 1024, "E": 64, "k": 8},
    "decode T=1": {"T": 1, "H": 2048, "I": 1024, "E": 64, "k": 8},
    # DeepSeek-V3's E=256 k=8 H=7168 with I=2048 / 8: 2.6 GiB of bf16 weights, not 21 GiB
    "DeepSeek-like I/8": {"T": 64, "H": 7168, "I": 256, "E": 256, "k": 8},
}
DECODE_TARGETED = "decode T=64"
QUANT_KERNELS = {
    "fp8": "any_fp8_fp8_bf16_torch",
    "mxfp8": "any_mxfp8_mxfp8_bf16_torch",
    "nvfp4": "any_nvfp4_nvfp4_bf16_torch",
    "fp8_fp4": "any_fp8_fp4_bf16_torch",
    "fp8_mxfp4": "any_fp8_mxfp4_bf16_torch",
    "fp8_nvfp4": "any_fp8_nvfp4_bf16_torch",
    "mxfp8_mxfp4": "any_mxfp8_mxfp4_bf16_torch",
}
# The targets of issue 16 (docs/runbook.md, Benchmarks): one copy, in moe_ep.bench.targets
VS_LIMIT = targets.VS_LIMIT
PEER_OVER_LAYER_DECODE = targets.PEER_OVER_LAYER_DECODE
PEER_OVER_LAYER = targets.PEER_OVER_LAYER
VS_DENSE = {"T=512": targets.VS_DENSE_MID, "prefill": targets.VS_DENSE_PREFILL}
QUANT_VS_LIMIT = targets.QUANT_VS_LIMIT
CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
BASELINE = "layer baseline"
"""The layer on the --baseline-kernel library (timed only when one is given)."""
PREPACKED = "layer prepacked"
"""The bf16 layer with `cpu_prepacked_weights=True` (timed only with --cpu-prepacked-weights)."""


def bandwidth(reps: int) -> float:
    """Median read bandwidth (bytes / s) at the current thread count."""
    return statistics.median(read_bandwidth(reps))


def active_experts(ids: torch.Tensor) -> int:
    return int(ids.unique().numel())


def bf16_weight_bytes(shape: Shape) -> int:
    """Bytes of one expert's bf16 weights (w13 and w2)."""
    return 3 * shape["H"] * shape["I"] * 2


@dataclass
class ShapeResult:
    name: str
    shape: Shape
    times: dict[str, Samples]
    limit_s: float
    skipped: dict[str, str]

    def peer_best(self) -> tuple[str, float] | None:
        peers = {k: v.median for k, v in self.times.items() if k.startswith("hf ")}
        if not peers:
            return None
        best = min(peers, key=lambda k: peers[k])
        return best, peers[best]

    def dense_best(self) -> float:
        """The faster of the bf16 and fp32 dense GEMMs of equal FLOPs (median s)."""
        return min(self.times[k].median for k in ("dense", "dense fp32") if k in self.times)


def time_peer_shape(
    name: str,
    shape: Shape,
    reps: int,
    bw: float,
    problem: Callable[[Shape], dict[str, torch.Tensor]],
    make_layer: Callable[..., object],
    naive: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    baseline: ctypes.CDLL | None = None,
    prepacked: bool = False,
) -> ShapeResult:
    """The layer, dense GEMMs of equal FLOPs, the naive loop and each transformers experts
    implementation on one shape, same weights and routing; with `baseline`, the layer once
    more on that fused CPU library ("layer baseline"); with `prepacked`, once more with
    `cpu_prepacked_weights=True` ("layer prepacked")."""
    p = problem(shape)
    layer = make_layer(p, shape)
    packed_layer = make_layer(p, shape, prepacked=True) if prepacked else None
    tensors = MoEEpTensors(p["x"], p["ids"], p["w"])
    pairs, h, i = shape["T"] * shape["k"], shape["H"], shape["I"]
    fns: dict[str, Callable[[], object]] = {
        "layer": lambda: layer(tensors),  # type: ignore[operator]
        "dense": dense_gemms(pairs, h, i, torch.bfloat16),
        "dense fp32": dense_gemms(pairs, h, i, torch.float32),
        "naive": lambda: naive(p),
    }
    if baseline is not None:
        fns[BASELINE] = with_library(baseline, lambda: layer(tensors))  # type: ignore[operator]
    if packed_layer is not None:
        fns[PREPACKED] = lambda: packed_layer(tensors)  # type: ignore[operator]
    skipped: dict[str, str] = {}
    why = hf_moe.unavailable()
    for impl in hf_moe.IMPLEMENTATIONS:
        if why is not None:
            skipped[f"hf {impl}"] = why
            continue
        if impl == "batched_mm" and pairs * bf16_weight_bytes(shape) > hf_moe.BATCHED_MM_MAX_BYTES:
            skipped[f"hf {impl}"] = "gathers a weight copy per pair: too large"
            continue
        fwd = hf_moe.experts_forward(p["w13"], p["w2"], shape["k"], impl)
        fns[f"hf {impl}"] = lambda fwd=fwd: fwd(p["x"], p["ids"], p["w"])
    times = round_robin(fns, reps)
    limit = active_experts(p["ids"]) * bf16_weight_bytes(shape) / bw
    layer.destroy()  # type: ignore[attr-defined]
    if packed_layer is not None:
        packed_layer.destroy()  # type: ignore[attr-defined]
    return ShapeResult(name, shape, times, limit, skipped)


@dataclass
class QuantResult:
    fmt: str
    layer: Samples
    limit_s: float
    weight_bytes: int
    baseline: Samples | None = None
    unpacked: Samples | None = None
    """The layer with `cpu_prepacked_weights=False`, where the default packs its weights."""


UNPACKED = "layer unpacked"
"""A quantized layer with `cpu_prepacked_weights=False` (timed only with
--cpu-prepacked-weights, where the default packs)."""


def time_quantized(
    shape: Shape,
    reps: int,
    bw: float,
    problem: Callable[[Shape], dict[str, torch.Tensor]],
    make_layer: Callable[..., object],
    baseline: ctypes.CDLL | None = None,
    prepacked: bool = False,
) -> list[QuantResult]:
    """Each quantized portable format's layer at a decode shape, against the bytes its own
    stored weights (codes and scales) of the active experts take to read (and on the
    `baseline` library too, and with `prepacked` once more with `cpu_prepacked_weights=False`
    where the default packs the format's weights (`experts.packs_by_default`), in the same
    round robin)."""
    p = problem(shape)
    tensors = MoEEpTensors(p["x"], p["ids"], p["w"])
    active = active_experts(p["ids"])
    out = []
    for fmt, kernel_name in QUANT_KERNELS.items():
        layer = make_layer(p, shape, kernel_name)
        prepared = layer._kernel.prepared  # type: ignore[attr-defined]
        one = MoEWeightPack(p["w13"][:1], p["w2"][:1])  # the format's stored form of an expert
        stored = layer._kernel.recipe.prepare(one)  # type: ignore[attr-defined]
        per_expert = stored.stored13.nbytes() + stored.stored2.nbytes()
        fns: dict[str, Callable[[], object]] = {fmt: lambda layer=layer: layer(tensors)}  # type: ignore[operator]
        base_layer = None
        if baseline is not None:  # built on that library: its packing choices (fp8's codes
            # pack only where the library reads them), then timed on it
            build = functools.partial(make_layer, p, shape, kernel_name)
            base_layer = with_library(baseline, build)()
            fns[BASELINE] = with_library(baseline, lambda b=base_layer: b(tensors))  # type: ignore[operator]
        unpack = prepacked and prepared.kpack13 is not None  # the default packed it
        other = make_layer(p, shape, kernel_name, False) if unpack else None
        if other is not None:
            fns[UNPACKED] = lambda other=other: other(tensors)  # type: ignore[operator]
        times = round_robin(fns, reps)
        out.append(
            QuantResult(
                fmt, times[fmt], active * per_expert / bw, active * per_expert,
                times.get(BASELINE), times.get(UNPACKED),
            )
        )  # fmt: skip
        for made in (layer, other, base_layer):
            if made is not None:
                made.destroy()  # type: ignore[attr-defined]
    return out


@dataclass
class CrossoverPoint:
    fmt: str
    rows: int
    gemm: Samples
    mm: Samples
    mm_prepacked: Samples | None = None
    gemm_prepacked: Samples | None = None


def crossover(
    reps: int, experts_n: int = 4, h: int = 2048, i: int = 1024, prepacked: bool = False
) -> list[CrossoverPoint]:
    """`run_experts` with every expert on the expert GEMM of few rows, then on the `mm`
    blocks, at each row count per expert: bf16 and (as the quantized formats' fp32 path)
    mxfp8; with `prepacked`, bf16 also on prepacked weights (`experts.prepack`) in the same
    round robin: the `mm` blocks where torch has oneDNN's bf16 GEMMs, else the expert GEMM
    (the k order on packed weights)."""
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(experts_n, 2 * i, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(experts_n, h, i, generator=g) / i**0.5).bfloat16()
    pack = MoEWeightPack(w13, w2)
    points = []
    for fmt, recipe in (("bf16", recipes.Bf16Recipe()), ("mxfp8", recipes.Mxfp8Recipe())):
        pw = recipe.prepare(pack)
        packs = prepacked and experts.prepack_unavailable(pw, torch.device("cpu")) is None
        pk = experts.prepack(pw) if packs else None
        for m in CROSSOVER_ROWS:
            pairs = m * experts_n
            rows = torch.randn(pairs, h).to(pw.w2t.dtype)
            src = torch.arange(pairs)
            y = torch.empty(pairs, h, dtype=torch.bfloat16)
            ws = Workspace()
            counts = [m] * experts_n

            def run(limit: int, pw: recipes.PreparedWeights = pw, rows: torch.Tensor = rows,
                    src: torch.Tensor = src, y: torch.Tensor = y, ws: Workspace = ws,
                    counts: list[int] = counts) -> None:  # fmt: skip
                saved = experts.expert_gemm_rows
                experts.expert_gemm_rows = lambda weights, device: limit  # type: ignore[assignment]
                try:
                    experts.run_experts(rows, src, counts, pw, None, None, y, ws)
                finally:
                    experts.expert_gemm_rows = saved  # type: ignore[assignment]

            fns: dict[str, Callable[[], object]] = {
                "gemm": lambda run=run: run(1 << 30),
                "mm": lambda run=run: run(0),
            }
            if pk is not None and pk.kpack13 is not None:
                fns["gemm prepacked"] = lambda run=run, pk=pk: run(1 << 30, pk)
            elif pk is not None:
                fns["mm prepacked"] = lambda run=run, pk=pk: run(0, pk)
            t = round_robin(fns, reps)
            points.append(
                CrossoverPoint(
                    fmt, m, t["gemm"], t["mm"], t.get("mm prepacked"), t.get("gemm prepacked")
                )
            )
    return points


def peer_rows(results: list[ShapeResult]) -> list[dict[str, object]]:
    """Per shape: the ratios the targets judge (None where a figure is missing)."""
    rows = []
    for r in results:
        layer = r.times["layer"].median
        best = r.peer_best()
        rows.append(
            {
                "vs_limit": layer / r.limit_s,
                "dense_vs_limit": r.dense_best() / r.limit_s,
                "vs_dense": layer / r.dense_best(),
                "peer_over_layer": None if best is None else best[1] / layer,
                "peer_vs_limit": None if best is None else best[1] / r.limit_s,
                "naive_over_layer": r.times["naive"].median / layer,
                "best_peer": None if best is None else best[0],
            }
        )
    return rows


def _judged(ratios: dict[str, object], tg: dict[str, Target | None]) -> str:
    """A row's status from its `peer_rows` ratios, with the notes where a target is beyond
    the dense GEMMs' speed or the bandwidth limit on this machine (`with_bound_note`)."""
    judged = row_status((k, ratios[k], tg[k]) for k in tg)  # type: ignore[misc]
    judged = with_bound_note(
        judged,
        tg["vs_limit"],
        cast(float, ratios["vs_limit"]),
        cast(float, ratios["dense_vs_limit"]),
        DENSE_TOO,
    )
    if ratios["peer_over_layer"] is None:
        return judged
    return with_bound_note(
        judged,
        tg["peer_over_layer"],
        cast(float, ratios["peer_over_layer"]),
        cast(float, ratios["peer_vs_limit"]),
        AT_LIMIT,
    )


def quant_dense_vs_limit(results: list[ShapeResult], quant: list[QuantResult]) -> list[float]:
    """Per quantized format, the decode shape's dense GEMMs of equal FLOPs over the
    format's own limit (the quantized orders are fp32 fma's too); empty when that shape
    was not timed."""
    decode = [r for r in results if r.name == DECODE_TARGETED]
    return [decode[0].dense_best() / q.limit_s for q in quant] if decode else []


def targets_of(name: str) -> dict[str, Target | None]:
    decode = name == DECODE_TARGETED
    return {
        "vs_limit": VS_LIMIT if decode else None,
        "vs_dense": VS_DENSE.get(name),
        "peer_over_layer": PEER_OVER_LAYER_DECODE if decode else PEER_OVER_LAYER,
    }


def print_peers(
    out: Console,
    results: list[ShapeResult],
    quant: list[QuantResult],
    bw: float,
    machine: str,
    reps: int,
) -> None:
    """The issue's table with the new figures and a status column, then the quantized one
    (each with the baseline library's layer and its ratio to the layer, when timed)."""
    base = [BASELINE, "baseline/layer"] if any(BASELINE in r.times for r in results) else []
    packed = [PREPACKED, "layer/prepacked"] if any(PREPACKED in r.times for r in results) else []
    table = titled_table(
        "portable bf16 layer (EP1) vs its limits and transformers' experts",
        f"median of {reps} round-robin runs (min-max in ms); read bandwidth {bw / 1e9:.1f} GB/s",
        machine,
        (
            "shape",
            "bw limit",
            "dense bf16",
            "dense fp32",
            "layer",
            *base,
            *packed,
            "naive",
            *(f"hf {i}" for i in hf_moe.IMPLEMENTATIONS),
            "layer/limit",
            "dense/limit",
            "layer/dense",
            "peer best/layer",
            "status",
        ),
        caption="bw limit = active experts' bf16 weight bytes / read bandwidth; dense = the "
        "faster of the bf16 and fp32 GEMMs of equal FLOPs (dense/limit over a limit target: "
        "the machine's arithmetic misses it too, noted in the status, as is a peer target only "
        "a layer under its bandwidth limit could meet); peer = "
        "transformers Qwen3-MoE experts block on the same weights and routing; targets: "
        f"decode T=64 layer/limit {VS_LIMIT.label()} and peer/layer "
        f"{PEER_OVER_LAYER_DECODE.label()}; every shape peer/layer {PEER_OVER_LAYER.label()}; "
        f"T=512 layer/dense {VS_DENSE['T=512'].label()}; prefill {VS_DENSE['prefill'].label()}"
        + (
            "; layer prepacked = the layer with cpu_prepacked_weights=True (the ratios judged "
            "are the default layer's)"
            if packed
            else ""
        ),
    )
    for r, ratios in zip(results, peer_rows(results), strict=True):

        def cell(key: str, r: ShapeResult = r) -> str:
            if key in r.skipped:
                return "skipped"
            s = r.times[key]
            return f"{s.median * 1e3:.1f} ({s.spread()})"

        tg = targets_of(r.name)
        table.add_row(
            f"{r.name}\n{shape_text(r.shape)}",
            f"{r.limit_s * 1e3:.1f}",
            cell("dense"),
            cell("dense fp32"),
            cell("layer"),
            *(
                [cell(BASELINE), f"{r.times[BASELINE].median / r.times['layer'].median:.2f}x"]
                if base
                else []
            ),
            *(
                [cell(PREPACKED), f"{r.times['layer'].median / r.times[PREPACKED].median:.2f}x"]
                if packed
                else []
            ),
            cell("naive"),
            *(cell(f"hf {i}") for i in hf_moe.IMPLEMENTATIONS),
            f"{ratios['vs_limit']:.2f}x",
            f"{ratios['dense_vs_limit']:.2f}x",
            f"{ratios['vs_dense']:.2f}x",
            "n/a" if ratios["peer_over_layer"] is None else f"{ratios['peer_over_layer']:.2f}x",
            _judged(ratios, tg),
        )
    out.print(table)
    for r in results:
        for k, why in r.skipped.items():
            out.print(f"{r.name}: {k} skipped: {why}")
    if quant:
        dense = quant_dense_vs_limit(results, quant)
        qpacked = [UNPACKED, "unpacked/layer"] if any(q.unpacked for q in quant) else []
        qt = titled_table(
            "quantized portable formats at decode vs their own weight bytes",
            f"{DECODE_TARGETED} {shape_text(PEER_SHAPES[DECODE_TARGETED])}",
            machine,
            (
                "format",
                "active weight bytes",
                "limit",
                "layer",
                *base,
                *qpacked,
                "layer/limit",
                *(["dense/limit"] if dense else []),
                "target",
                "status",
            ),
        )
        for i, q in enumerate(quant):
            ratio = q.layer.median / q.limit_s
            judged = status(ratio, QUANT_VS_LIMIT)
            layer = q.layer.median
            qt.add_row(
                q.fmt,
                f"{q.weight_bytes / 2**20:.0f} MiB",
                f"{q.limit_s * 1e3:.1f} ms",
                f"{layer * 1e3:.1f} ({q.layer.spread()})",
                *(_time_and_ratio(q.baseline, lambda t, m=layer: t.median / m) if base else []),
                *(_time_and_ratio(q.unpacked, lambda t, m=layer: t.median / m) if qpacked else []),
                f"{ratio:.2f}x",
                *([f"{dense[i]:.2f}x"] if dense else []),
                QUANT_VS_LIMIT.label(),
                with_bound_note(judged, QUANT_VS_LIMIT, ratio, dense[i], DENSE_TOO)
                if dense
                else judged,
            )
        out.print(qt)


def _time_and_ratio(
    t: Samples | None, ratio: Callable[[Samples], float], digits: int = 1
) -> list[str]:
    """Two cells: `t`'s median (spread) in ms and `ratio(t)`, blank where `t` was not timed."""
    if t is None:
        return ["", ""]
    return [f"{t.median * 1e3:.{digits}f} ({t.spread()})", f"{ratio(t):.2f}x"]


def print_crossover(out: Console, points: list[CrossoverPoint], machine: str) -> None:
    packed = any(pt.mm_prepacked is not None for pt in points)
    kpacked = any(pt.gemm_prepacked is not None for pt in points)
    table = titled_table(
        "run_experts: expert GEMM of few rows vs the mm blocks",
        "4 experts, H=2048 I=1024, every expert the same row count; medians (min-max) in ms",
        machine,
        (
            "format",
            "rows / expert",
            "expert GEMM",
            "mm blocks",
            "mm / expert GEMM",
            *(["mm prepacked", "prepacked / expert GEMM"] if packed else []),
            *(["expert GEMM prepacked", "mm / prepacked GEMM"] if kpacked else []),
        ),
    )
    for pt in points:
        gemm, mm = pt.gemm.median, pt.mm.median
        table.add_row(
            pt.fmt,
            str(pt.rows),
            f"{gemm * 1e3:.2f} ({pt.gemm.spread()})",
            f"{mm * 1e3:.2f} ({pt.mm.spread()})",
            f"{mm / gemm:.2f}x",
            *(
                _time_and_ratio(pt.mm_prepacked, lambda t, g=gemm: t.median / g, 2)
                if packed
                else []
            ),
            *(
                _time_and_ratio(pt.gemm_prepacked, lambda t, m=mm: m / t.median, 2)
                if kpacked
                else []
            ),
        )
    out.print(table)


def _short_peer(name: str) -> str:
    """A peer's name short enough for seven tick labels side by side ("hf grouped_mm" ->
    "grouped", the tick label's last line)."""
    return name.removeprefix("hf ").removesuffix("_mm")


def _dense_marks(ax: Any, values: list[float]) -> None:
    """A marker over each bar of `ax` (ratio_bars' positions): the dense GEMMs of equal
    FLOPs against the same limit, where the machine's arithmetic alone lands."""
    ax.plot(range(len(values)), values, "D", color="black", markersize=5, zorder=3,
            label="dense GEMMs of equal FLOPs / limit")  # fmt: skip
    bottom, top = ax.get_ylim()
    ax.set_ylim(bottom, max(top, max(values, default=0.0) * 1.15))
    ax.legend(loc="upper left", fontsize=7, frameon=False)


def _not_run(ax: Any, section: str) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, f"not run (--sections {section})", ha="center", transform=ax.transAxes)


def plot_peers(
    results: list[ShapeResult],
    quant: list[QuantResult],
    points: list[CrossoverPoint],
    title_line: str,
    machine: str,
    path: Path,
) -> Path:
    """Ratios against their target lines: layer / bandwidth limit, peer / layer, layer /
    dense, quantized / own limit, and the crossover sweep."""
    fig, axes = plots.figure(2, 3, width=17, height=9)
    plots.title(fig, "portable layer vs limits and transformers (issue 16)", title_line, machine)
    names = [r.name for r in results]
    ratios = peer_rows(results)
    # prefill reads each weight about a thousand times: its 20-40x would flatten the bars
    # the bandwidth limit is about (it stays in the table)
    bound = [(n, x) for n, x in zip(names, ratios, strict=True) if n != "prefill"]
    if not results:  # a crossover-only run
        for ax in axes[:4]:
            _not_run(ax, "peers")
    shown = (
        []
        if not results
        else plots.ratio_bars(
            axes[0],
            [n for n, _ in bound],
            [x["vs_limit"] for _, x in bound],
            [targets_of(n)["vs_limit"] for n, _ in bound],  # type: ignore[misc]
            wrap=7,  # "decode T=64" on two lines: six names side by side
        )
    )
    if bound:
        _dense_marks(axes[0], [x["dense_vs_limit"] for _, x in bound])  # type: ignore[misc]
    axes[0].set_title("layer / its bandwidth limit (lower is better; prefill: table)", fontsize=9)
    have = [(n, x) for n, x in zip(names, ratios, strict=True) if x["peer_over_layer"] is not None]
    if have:
        shown += plots.ratio_bars(
            axes[1],
            [f"{n}\n{_short_peer(str(x['best_peer']))}" for n, x in have],
            [x["peer_over_layer"] for _, x in have],  # type: ignore[misc]
            [targets_of(n)["peer_over_layer"] for n, _ in have],
            wrap=7,
        )
    axes[1].set_title("transformers' fastest / layer (higher is better)", fontsize=9)
    if results:
        shown += plots.ratio_bars(
            axes[2],
            names,
            [x["vs_dense"] for x in ratios],
            [targets_of(n)["vs_dense"] for n in names],  # type: ignore[misc]
            wrap=7,
        )
    axes[2].set_title("layer / faster dense GEMM, equal FLOPs (lower: better)", fontsize=9)
    if quant:
        shown += plots.ratio_bars(
            axes[3],
            [q.fmt.replace("_", "_\n", 1) for q in quant],  # seven side by side: two lines
            [q.layer.median / q.limit_s for q in quant],
            [QUANT_VS_LIMIT] * len(quant),
        )
        dense = quant_dense_vs_limit(results, quant)
        if dense:
            _dense_marks(axes[3], dense)
    axes[3].set_title(f"quantized layer / own weight-bytes limit, {DECODE_TARGETED}", fontsize=9)
    for fmt, ax in (("bf16", axes[4]), ("mxfp8", axes[5])):
        pts = [pt for pt in points if pt.fmt == fmt]
        if pts:
            xs = [pt.rows for pt in pts]
            ax.plot(xs, [pt.mm.median / pt.gemm.median for pt in pts], "o-", label="mm blocks")
            pks = [pt.mm_prepacked for pt in pts if pt.mm_prepacked is not None]
            if len(pks) == len(pts):
                ys = [pk.median / pt.gemm.median for pk, pt in zip(pks, pts, strict=True)]
                ax.plot(xs, ys, "s--", label="mm blocks, prepacked weights")
                ax.legend(fontsize=8)
            kps = [pt.gemm_prepacked for pt in pts if pt.gemm_prepacked is not None]
            if len(kps) == len(pts):
                ys = [pt.mm.median / kp.median for kp, pt in zip(kps, pts, strict=True)]
                ax.plot(xs, ys, "s--", label="mm blocks / expert GEMM on prepacked weights")
                ax.legend(fontsize=8)
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("rows per expert")
        else:
            _not_run(ax, "crossover")
        ax.set_title(f"{fmt}: mm blocks / expert GEMM time (> 1: GEMM faster)", fontsize=9)
    for ax in axes:
        ax.set_ylabel("ratio")
    plots.status_legend(fig, shown)
    return plots.save(fig, path)

"""The bench's terminal table and its PNG plots (one per shape family)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moe_ep.bench.results import BenchRow
from moe_ep.bench.tables import titled_table

COLUMNS = (
    "shape",
    "H,I,E,k",
    "T/rank",
    "EP",
    "routing",
    "kernel",
    "median",
    "tokens/s",
    "TFLOP/s/rank",
    "/dense",
    "/bw limit",
    "/all_to_all",
    "naive/layer",
    "peer/layer",
    "status",
)
CAPTION = (
    "median of the timed runs after warm-up (a run's time: the slowest rank's); /dense: "
    "layer / the faster of bf16 and fp32 dense GEMMs of the same useful FLOPs; /bw limit: "
    "layer / (active experts' stored weight bytes / read bandwidth); /all_to_all: layer / a "
    "bare all_to_all_single of the bytes the busiest rank moves; naive: the per-expert loop; "
    "peer: transformers' fastest experts implementation (EP1); the status notes a /bw limit "
    "target the dense GEMMs miss too, and a peer target only a layer under its bandwidth "
    "limit could meet; targets (docs/runbook.md) at "
    "EP1, uniform routing, on the shapes they name; n/a: no target stated"
)


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _si(v: float | None, unit: str = "") -> str:
    if v is None:
        return "n/a"
    for bound, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(v) >= bound:
            return f"{v / bound:.1f}{suffix}{unit}"
    return f"{v:.1f}{unit}"


def _family_of(row: BenchRow) -> str:
    return f"{row.shape.family} {row.shape.dims()}"


def table(rows: Sequence[BenchRow], machine: str, what: str) -> Any:
    """The rich table of `rows` with a status column."""
    t = titled_table("moe-ep bench: forward time vs limits and peers", what, machine, COLUMNS)
    t.caption = CAPTION
    for r in rows:
        ratio = r.ratios()
        med = r.median
        s = r.shape
        t.add_row(
            s.family,
            f"{s.hidden},{s.inter},{s.experts},{s.topk}",
            str(s.tokens),
            str(r.world_size),
            r.routing,
            r.kernel,
            "skipped" if med is None else f"{med * 1e3:.2f} ms",
            _si(r.tokens_per_s()),
            "n/a" if r.tflops() is None else f"{r.tflops():.3g}",
            _x(ratio["vs_dense"]),
            _x(ratio["vs_bandwidth"]),
            _x(ratio["vs_all_to_all"]),
            _x(ratio["naive_over_layer"]),
            _x(ratio["peer_over_layer"]),
            r.status(),
        )
    return t


def skip_lines(rows: Sequence[BenchRow]) -> list[str]:
    """One line per kernel and reason it was skipped for, naming the shapes."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r.skipped:
            seen.setdefault((r.kernel, r.skipped), []).append(f"{r.shape.text()} EP{r.world_size}")
    return [
        f"{kernel} skipped on {', '.join(dict.fromkeys(where))}: {why}"
        for (kernel, why), where in seen.items()
    ]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_").lower()


PANELS = (
    ("median", "median forward time (ms, lower is better)", "ms"),
    ("vs_bandwidth", "layer / bandwidth limit (lower is better)", "ratio"),
    ("vs_dense", "layer / dense GEMMs of equal FLOPs (lower is better)", "ratio"),
    ("peer_over_layer", "transformers' fastest / layer (higher is better)", "ratio"),
)


def _value(row: BenchRow, key: str) -> float:
    v = row.median if key == "median" else row.ratios()[key]
    if v is None:
        return float("nan")
    return v * 1e3 if key == "median" else v


def plot_families(rows: Sequence[BenchRow], machine: str, out_dir: Path) -> list[Path]:
    """One PNG per shape family: per world size (columns) the median time, layer /
    bandwidth limit, layer / dense and the peer's time / layer against tokens per rank
    (rows of panels, x log), one line per kernel (solid uniform, dashed skewed routing), a
    dashed black line at each stated target; the legend below the panels. Returns the
    paths."""
    from matplotlib import colormaps
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    from moe_ep.bench import plots

    families: dict[str, list[BenchRow]] = {}
    for r in rows:
        if r.median is not None:
            families.setdefault(_family_of(r), []).append(r)
    paths = []
    for fam, frows in families.items():
        sizes = sorted({r.world_size for r in frows})
        n = len(sizes)
        fig, axes = plots.figure(len(PANELS), n, width=4.6 * n + 3.5, height=13)
        what = "moe-ep bench: time and ratios against tokens per rank"
        plots.title(fig, what, fam, machine)
        kernels = list(dict.fromkeys(r.kernel for r in frows))
        single = len({r.shape.tokens for r in frows}) == 1
        for c, ws in enumerate(sizes):
            here = [r for r in frows if r.world_size == ws]
            for p, (key, title, unit) in enumerate(PANELS):
                ax = axes[p * n + c]
                if all(math.isnan(_value(r, key)) for r in here):  # e.g. the peer at EP > 1
                    _no_data(ax, f"EP{ws}: {title}", key)
                    continue
                if single:  # one token count: bars per kernel, not lines of one point
                    _bars(ax, here, kernels, key)
                else:
                    _lines(ax, here, kernels, key, colormaps["tab10"])
                    ax.set_xlabel("tokens per rank")
                    ax.set_yscale("log")
                    plain = FuncFormatter(lambda v, _: f"{v:g}")  # 3, not 3 x 10^0
                    ax.yaxis.set_major_formatter(plain)
                    ax.yaxis.set_minor_formatter(plain)
                if key != "median":
                    _target_lines(ax, here, key)
                ax.set_ylabel(unit)
                ax.grid(alpha=0.3)
                at = f", T={here[0].shape.tokens} per rank" if single else ""
                ax.set_title(f"EP{ws}{at}: {title}", fontsize=9)
        handles, labels = axes[0].get_legend_handles_labels()
        handles.append(Line2D([], [], color="black", linestyle="--", linewidth=1))
        labels.append("target (EP1, uniform)")
        fig.legend(
            handles,
            labels,
            loc="outside lower center",
            ncols=min(3, len(labels)),
            fontsize=8,
            frameon=False,
        )
        paths.append(plots.save(fig, out_dir / f"bench_{_slug(fam)}.png"))
    return paths


def _lines(ax: Any, rows: Sequence[BenchRow], kernels: list[str], key: str, cmap: Any) -> None:
    """One line per kernel and routing against tokens per rank (log 2 axis)."""
    for j, kernel in enumerate(kernels):
        for routing, style in (("uniform", "-"), ("skewed", "--")):
            pts = sorted(
                (r for r in rows if r.kernel == kernel and r.routing == routing),
                key=lambda r: r.shape.tokens,
            )
            if pts:
                ax.plot(
                    [r.shape.tokens for r in pts],
                    [_value(r, key) for r in pts],
                    style,
                    marker="osD^v<>"[j % 7],
                    color=cmap(j % 10),
                    label=f"{kernel} ({routing})",
                )
    ax.set_xscale("log", base=2)
    ticks = sorted({r.shape.tokens for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])


def _bars(ax: Any, rows: Sequence[BenchRow], kernels: list[str], key: str) -> None:
    """Side-by-side uniform / skewed bars per kernel (a family of one token count)."""
    for k, (routing, color) in enumerate((("uniform", "#457b9d"), ("skewed", "#f4a261"))):
        xs, ys = [], []
        for j, kernel in enumerate(kernels):
            row = next((r for r in rows if r.kernel == kernel and r.routing == routing), None)
            if row is not None:
                xs.append(j + (k - 0.5) * 0.38)
                ys.append(_value(row, key))
        if xs:
            bars = ax.bar(xs, ys, width=0.38, color=color, label=f"{routing} routing", zorder=2)
            ax.bar_label(bars, [f"{v:.3g}" for v in ys], fontsize=6, padding=1)
    short = [k.removeprefix("any_").removesuffix("_torch") for k in kernels]
    ax.set_xticks(range(len(kernels)), short, rotation=35, ha="right", fontsize=7)


def _no_data(ax: Any, title: str, key: str) -> None:
    """An empty panel that says why (the peer runs at EP1 only; else nothing measured)."""
    why = "transformers' experts run at EP1 only" if key == "peer_over_layer" else "not measured"
    ax.text(0.5, 0.5, why, ha="center", va="center", transform=ax.transAxes, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=9)


def _target_lines(ax: Any, rows: Sequence[BenchRow], key: str) -> None:
    """A dashed line at each stated target of ratio `key`, labelled with the tokens it
    judges."""
    judged: dict[Any, set[int]] = {}
    for r in rows:
        t = r.targets.get(key)
        if t is not None:
            judged.setdefault(t, set()).add(r.shape.tokens)
    for t, tokens in judged.items():
        at = ", ".join(str(n) for n in sorted(tokens))
        ax.axhline(t.bound, color="black", linestyle="--", linewidth=1)
        ax.annotate(
            f"target {t.label()} (T={at}, EP1 uniform)",
            xy=(0.01, t.bound),
            xycoords=ax.get_yaxis_transform(),
            xytext=(0, 3),
            textcoords="offset points",
            fontsize=7,
        )

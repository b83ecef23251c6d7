"""One look for every benchmark plot: a title with shape and machine, bars labelled with
their values and coloured by status, dashed target lines labelled in the margin, legends
outside the data."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.text import Text
from matplotlib.ticker import FuncFormatter, PercentFormatter

from moe_ep.bench.targets import NA, OK, OVER, UNDER, Target, status

STATUS_COLORS = {OK: "#2a9d8f", OVER: "#e76f51", UNDER: "#e76f51", NA: "#8d99ae"}
SERIES_COLORS = ("#457b9d", "#f4a261", "#8d99ae", "#2a9d8f")
_HEADROOM = 1.22  # room above the tallest bar for its value label


def figure(nrows: int, ncols: int, *, width: float, height: float) -> tuple[Figure, list[Axes]]:
    """A constrained-layout figure (nothing clipped, legends outside take their room) and its
    axes, row by row."""
    fig = Figure(figsize=(width, height), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def title(fig: Figure, what: str, shape: str, machine: str) -> None:
    """Three title lines: what is measured, on which shape, on which machine."""
    fig.suptitle(f"{what}\n{shape}\n{machine}", fontsize=10)


def _names(ax: Axes, names: Sequence[str], centers: Sequence[float], wrap: int) -> None:
    """Tick labels, each line wrapped to `wrap` characters (at spaces and hyphens), smaller
    where a line is still longer than `wrap` (so that neighbours do not overlap)."""
    shown = [
        "\n".join(
            textwrap.fill(line, wrap, break_long_words=False, break_on_hyphens=True)
            for line in n.split("\n")
        )
        for n in names
    ]
    longest = max((len(line) for n in shown for line in n.split("\n")), default=0)
    ax.set_xticks(list(centers), shown, fontsize=8 if longest <= wrap else 7)


def target_line(
    ax: Axes, target: Target, xmin: float, xmax: float, nudge_pt: float | None = 0
) -> None:
    """A dashed line at the target's bound over [xmin, xmax], labelled in the right margin
    (outside the data) with the bound and what it applies to; `nudge_pt` moves the label
    up, away from a neighbour's; None: no label (another segment of the target has it)."""
    ax.hlines(target.bound, xmin, xmax, colors="black", linestyles="--", linewidth=1, zorder=3)
    if nudge_pt is None:
        return
    scope = f" ({target.applies_to})" if target.applies_to else ""
    ax.annotate(
        f"target {target.label()}{scope}",
        xy=(1, target.bound),
        xycoords=ax.get_yaxis_transform(),
        xytext=(4, nudge_pt),
        textcoords="offset points",
        va="center",
        fontsize=8,
    )


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """(first, last) of each run of consecutive positions, e.g. [0, 2, 3] -> [(0, 0), (2, 3)]."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and p == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], p)
        else:
            runs.append((p, p))
    return runs


def label_nudges(fractions: Sequence[float], height_pt: float, gap_pt: float = 11) -> list[float]:
    """Upward offsets (points) that keep margin labels at axes fractions `fractions`
    (ascending) at least `gap_pt` apart on axes `height_pt` tall."""
    placed: list[float] = []
    for f in fractions:
        want = f * height_pt
        placed.append(max(want, placed[-1] + gap_pt) if placed else want)
    return [p - f * height_pt for p, f in zip(placed, fractions, strict=True)]


def _close_below(value: float, bound: float, span: float, log: bool) -> bool:
    """Whether a label on top of a bar of `value` would overlap a line at `bound`."""
    return bound / max(value, 1e-300) < 1.3 if log else bound - value < 0.08 * span


def _boxed(text: Text) -> None:
    """A value label readable over grid and target lines."""
    text.set_bbox({"facecolor": "white", "alpha": 0.8, "pad": 0.5, "edgecolor": "none"})
    text.set_zorder(4)


def _label_values(ax: Axes, bars: BarContainer, texts: Sequence[str], **kw: object) -> None:
    for text in ax.bar_label(bars, list(texts), padding=2, **kw):  # type: ignore[arg-type]
        _boxed(text)


def ratio_bars(
    ax: Axes,
    names: Sequence[str],
    values: Sequence[float],
    targets: Sequence[Target | None],
    *,
    unit: str = "x",
    fmt: Callable[[float], str] | None = None,
    wrap: int = 14,
) -> list[str]:
    """One bar per ratio, coloured by its status against its target, its value written on
    top; one dashed line per distinct target over the bars it applies to. The axis turns
    logarithmic when a value is more than 20x the largest target. `unit` "%" shows
    fractions as percentages; names wrap at `wrap` characters. Returns each bar's status."""
    if not len(names) == len(values) == len(targets):
        raise ValueError(
            f"ratio_bars needs one name, value and target per bar, got "
            f"{len(names)}, {len(values)}, {len(targets)}"
        )
    statuses = [status(v, t) for v, t in zip(values, targets, strict=True)]
    colors = [STATUS_COLORS[s] for s in statuses]
    pos = list(range(len(values)))
    ax.bar(pos, values, width=0.6, color=colors, zorder=2)
    if fmt is None:
        fmt = (lambda v: f"{v * 100:.0f}%") if unit == "%" else (lambda v: f"{v:.2f}x")
    _names(ax, names, pos, wrap)
    distinct = sorted(dict.fromkeys(t for t in targets if t is not None), key=lambda t: t.bound)
    every = [v for v in [*values, *(t.bound for t in distinct)] if v > 0]
    low, top = min(every, default=1.0), max(every, default=1.0)
    log = bool(distinct) and top > 20 * max(t.bound for t in distinct)
    if log:  # an outlier far past the targets would flatten every other bar on a linear axis
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{unit}"))
        ax.set_ylim(low / 2, top * _HEADROOM**3)
        lo, hi = (math.log(v) for v in ax.get_ylim())
        fractions = [(math.log(t.bound) - lo) / (hi - lo) for t in distinct]
    else:
        ax.set_ylim(0, top * _HEADROOM)
        fractions = [t.bound / (top * _HEADROOM) for t in distinct]
    for p, v, t in zip(pos, values, targets, strict=True):
        y = v
        if t is not None and v < t.bound and _close_below(v, t.bound, top * _HEADROOM, log):
            y = t.bound  # a label just below a target line would sit on it: lift it above
        text = ax.annotate(
            fmt(v), (p, y), xytext=(0, 2), textcoords="offset points", ha="center", va="bottom"
        )
        text.set_fontsize(8)
        _boxed(text)
    height_pt = ax.get_position().height * ax.figure.bbox.height / ax.figure.dpi * 72
    for target, nudge in zip(distinct, label_nudges(fractions, height_pt), strict=True):
        covered = [p for p, t in zip(pos, targets, strict=True) if t == target]
        for first, last in _runs(covered):  # never across a bar the target does not cover
            target_line(ax, target, first - 0.4, last + 0.4, nudge if first == covered[0] else None)
    ax.set_xlim(-0.6, len(values) - 0.4)
    if unit == "%":
        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.grid(axis="y", alpha=0.3, zorder=0)
    return statuses


def grouped_bars(
    ax: Axes,
    names: Sequence[str],
    series: Mapping[str, Sequence[float]],
    fmt: Callable[[float], str],
    wrap: int = 14,
) -> list[BarContainer]:
    """Side-by-side bars, one colour per series, each with its value written on top, and the
    series' legend to the right of the axes (off the data)."""
    width = 0.8 / max(len(series), 1)
    out = []
    for j, (label, values) in enumerate(series.items()):
        if len(values) != len(names):
            raise ValueError(f"series {label!r} has {len(values)} values for {len(names)} names")
        offset = (j - (len(series) - 1) / 2) * width
        bars = ax.bar(
            [p + offset for p in range(len(names))],
            values,
            width=width,
            label=label,
            color=SERIES_COLORS[j % len(SERIES_COLORS)],
            zorder=2,
        )
        _label_values(ax, bars, [fmt(v) for v in values], fontsize=7, rotation=90)
        out.append(bars)
    _names(ax, names, range(len(names)), wrap)
    top = max((v for values in series.values() for v in values), default=1.0)
    ax.set_ylim(0, top * _HEADROOM * 1.05)
    ax.grid(axis="y", alpha=0.3, zorder=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return out


def status_legend(fig: Figure, statuses: Iterable[str], *, with_target: bool = True) -> None:
    """The colour key of the `statuses` shown by `ratio_bars` (and the target line), below
    all axes."""
    shown = set(statuses)
    keys = (
        ({OK}, STATUS_COLORS[OK], "ok"),
        ({OVER, UNDER}, STATUS_COLORS[OVER], "target missed"),
        ({NA}, STATUS_COLORS[NA], "no target (reported)"),
    )
    handles: list[Patch | Line2D] = [
        Patch(color=color, label=label) for kinds, color, label in keys if kinds & shown
    ]
    if with_target:
        handles.append(Line2D([], [], color="black", linestyle="--", linewidth=1, label="target"))
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)


def save(fig: Figure, path: Path) -> Path:
    """Write `fig` as a PNG at `path` (creating its folder) and return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path

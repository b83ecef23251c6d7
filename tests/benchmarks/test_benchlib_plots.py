"""`moe_ep.bench.plots`: ratios against labelled target lines, values on the bars, legends and
labels outside the data, titles with the shape and the machine."""

from __future__ import annotations

import itertools
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import LineCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.text import Annotation

from moe_ep.bench import plots
from moe_ep.bench.targets import NA, OK, OVER, UNDER, Target

LAYER = Target("<=", 1.3, applies_to="prefill")
NAIVE = Target(">", 1.0)


def _drawn(fig: Figure) -> FigureCanvasAgg:
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas


def _target_lines(ax: Axes) -> list[tuple[float, float, float]]:
    """(y, xmin, xmax) of each dashed target segment."""
    out = []
    for c in ax.collections:
        if isinstance(c, LineCollection):
            for seg in c.get_segments():
                (x0, y0), (x1, _) = seg
                out.append((float(y0), float(x0), float(x1)))
    return out


def _texts(ax: Axes) -> list[str]:
    return [t.get_text() for t in ax.texts]


def test_bars_are_coloured_by_status_labelled_and_the_target_spans_its_bars() -> None:
    _, (ax,) = plots.figure(1, 1, width=8, height=4)
    shown = plots.ratio_bars(
        ax, ["prefill 1t", "decode 1t", "prefill 2t"], [1.2, 2.9, 1.45], [LAYER, None, LAYER]
    )
    assert shown == [OK, NA, OVER]
    colors = [p.get_facecolor()[:3] for p in ax.patches]
    assert colors == [to_rgb(plots.STATUS_COLORS[s]) for s in shown]
    assert {"1.20x", "2.90x", "1.45x"} <= set(_texts(ax))
    assert _texts(ax).count("target <= 1.3x (prefill)") == 1
    # at the bound over bars 0 and 2 (the target's), not across bar 1 (no target) between
    assert _target_lines(ax) == [(1.3, -0.4, 0.4), (1.3, 1.6, 2.4)]


def test_each_target_line_covers_only_its_own_bars() -> None:
    fp8, fp4 = Target("<=", 5.0, applies_to="fp8"), Target("<=", 8.0, applies_to="fp4")
    _, (ax,) = plots.figure(1, 1, width=8, height=4)
    plots.ratio_bars(ax, list("abcd"), [1.0, 2.0, 4.5, 6.0], [fp8, fp8, fp4, fp4])
    assert sorted(_target_lines(ax)) == [(5.0, -0.4, 1.4), (8.0, 1.6, 3.4)]


def test_percent_targets_and_missed_lower_bounds() -> None:
    _, (ax,) = plots.figure(1, 1, width=6, height=4)
    rate = Target(">=", 0.8, unit="%")
    assert plots.ratio_bars(ax, ["a", "b"], [0.9, 0.5], [rate, rate], unit="%") == [OK, UNDER]
    assert {"90%", "50%", "target >= 80%"} <= set(_texts(ax))


def test_an_outlier_far_past_the_targets_turns_the_axis_logarithmic() -> None:
    _, (ax,) = plots.figure(1, 1, width=6, height=4)
    plots.ratio_bars(ax, ["a", "b"], [1.2, 196.0], [Target("<=", 8.0)] * 2)
    assert ax.get_yscale() == "log"
    _, (ax,) = plots.figure(1, 1, width=6, height=4)
    plots.ratio_bars(ax, ["a", "b"], [1.2, 170.0], [Target("<=", 8.0), None])  # > 20 x 8
    assert ax.get_yscale() == "log"
    _, (ax,) = plots.figure(1, 1, width=6, height=4)
    plots.ratio_bars(ax, ["a", "b"], [0.9, 7.9], [Target("<=", 8.0)] * 2)
    assert ax.get_yscale() == "linear"
    assert ax.get_ylim()[1] > 7.9  # room above the tallest bar for its label


def test_a_value_label_just_below_a_target_line_is_lifted_above_it() -> None:
    _, (ax,) = plots.figure(1, 1, width=6, height=4)
    plots.ratio_bars(ax, ["near", "far"], [1.25, 0.5], [LAYER, LAYER])
    where = {t.get_text(): t.xy[1] for t in ax.texts if isinstance(t, Annotation)}
    assert where["1.25x"] == 1.3  # on the line's level, drawn above it
    assert where["0.50x"] == 0.5  # far below: on its bar


def test_label_nudges_keep_close_margin_labels_apart() -> None:
    assert plots.label_nudges([0.2, 0.8], 300) == [0.0, 0.0]
    nudges = plots.label_nudges([0.50, 0.52, 0.53], 300, gap_pt=11)
    placed = [f * 300 + n for f, n in zip([0.50, 0.52, 0.53], nudges, strict=True)]
    assert nudges[0] == 0 and all(b - a >= 11 - 1e-9 for a, b in itertools.pairwise(placed))


def test_legends_and_target_labels_stay_off_the_data() -> None:
    fig, axes = plots.figure(1, 2, width=10, height=4)
    shown = plots.ratio_bars(axes[0], ["a", "b"], [1.2, 1.5], [LAYER, LAYER])
    plots.grouped_bars(axes[1], ["a", "b"], {"s1": [1.0, 2.0], "s2": [1.5, 0.5]}, str)
    plots.status_legend(fig, shown)
    canvas = _drawn(fig)
    renderer = canvas.get_renderer()
    boxes = [ax.get_window_extent(renderer) for ax in axes]
    assert fig.legends, "the status key is a figure legend"
    series = axes[1].get_legend()
    assert series is not None, "grouped_bars labels its series"
    for legend in (*fig.legends, series):
        extent = legend.get_window_extent(renderer)
        assert not any(extent.overlaps(box) for box in boxes), "legend over an axes"
    label = next(t for t in axes[0].texts if t.get_text().startswith("target"))
    assert label.get_window_extent(renderer).x0 >= boxes[0].x1  # in the right margin
    # the figure legend only lists what is shown: ok and missed, no "no target" entry
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["ok", "target missed", "target"]


def test_title_names_what_shape_and_machine(tmp_path: Path) -> None:
    fig, _ = plots.figure(1, 1, width=6, height=4)
    plots.title(fig, "layer / dense", "prefill T=4096 H=2048", "AMD EPYC, 2 logical CPUs")
    assert fig.get_suptitle().splitlines() == [
        "layer / dense",
        "prefill T=4096 H=2048",
        "AMD EPYC, 2 logical CPUs",
    ]
    path = plots.save(fig, tmp_path / "sub" / "x.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

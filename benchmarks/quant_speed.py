"""Quantization speed on CPU: each moe_ep.quant format against one amax pass, side by side.

    uv run python benchmarks/quant_speed.py [--rows 4096] [--cols 7168] [--repeats 5]
        [--out benchmarks/out/quant_speed.png | --no-plot]

Measures, for each format, the time to quantize a [rows, cols] bf16 tensor and the time of
one `x.float().abs().amax(-1)` pass over the same tensor, run alternately (best of
--repeats each, so load from other processes hits both alike), and their ratio.
Targets (docs/runbook.md): ratio <= 5x for the fp8 formats (fp8, mxfp8), <= 8x for the
fp4 formats (nvfp4, mxfp4). Prints a table with a status column (ok / over target) and
plots the ratios against the target lines.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from benchlib import OUT_DIR
from benchlib.options import (
    add_plot_options,
    benchmark_parser,
    positive_int,
    positive_multiple_of,
)

import moe_ep.quant as q
from moe_ep.bench import plots
from moe_ep.bench.machine import this_machine
from moe_ep.bench.progress import Steps
from moe_ep.bench.tables import console, titled_table
from moe_ep.bench.targets import Target, status

FP8 = Target("<=", 5.0, applies_to="fp8 formats")
FP4 = Target("<=", 8.0, applies_to="fp4 formats")

FORMATS: dict[str, tuple[Callable[[torch.Tensor], object], Target]] = {
    "fp8 per-tensor e4m3": (lambda x: q.quantize_fp8_per_tensor(x), FP8),
    "fp8 per-row e4m3": (lambda x: q.quantize_fp8_per_row(x), FP8),
    "fp8 blockwise 1x128": (lambda x: q.quantize_fp8_blockwise(x), FP8),
    "fp8 blockwise 128x128": (lambda x: q.quantize_fp8_blockwise(x, block=(128, 128)), FP8),
    "fp8 blockwise 1x128 ue8m0": (
        lambda x: q.quantize_fp8_blockwise(x, scale_format="ue8m0"),
        FP8,
    ),
    "mxfp8 e4m3 ceil": (lambda x: q.quantize_mxfp8(x), FP8),
    "mxfp8 e4m3 ocp": (lambda x: q.quantize_mxfp8(x, rule="ocp"), FP8),
    "mxfp8 e5m2 ceil": (lambda x: q.quantize_mxfp8(x, dtype=torch.float8_e5m2), FP8),
    "nvfp4": (lambda x: q.quantize_nvfp4(x), FP4),
    "mxfp4": (lambda x: q.quantize_mxfp4(x), FP4),
}


def paired_best(
    fn: Callable[[], object], ref: Callable[[], object], repeats: int
) -> tuple[float, float]:
    """Best-of-`repeats` times of `fn` and `ref`, run alternately so that load from other
    processes on a shared machine hits both alike."""
    fn()  # warm-up (allocator, first touch)
    ref()
    best_fn = best_ref = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        ref()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        best_ref, best_fn = min(best_ref, t1 - t0), min(best_fn, t2 - t1)
    return best_fn, best_ref


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help; the docstring as description."""
    parser = benchmark_parser(__doc__ or "")
    parser.add_argument("--rows", type=positive_int, default=4096, help="rows of the tensor")
    parser.add_argument(
        "--cols",
        type=positive_multiple_of(128),
        default=7168,
        help="columns of the tensor (a multiple of 128: the blockwise formats' block)",
    )
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="timed runs of each; the best counts"
    )
    add_plot_options(parser, OUT_DIR / "quant_speed.png")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    x = torch.randn(args.rows, args.cols, dtype=torch.bfloat16)
    results: list[tuple[str, float, float, Target]] = []

    def ref() -> object:
        return x.float().abs().amax(-1)

    with Steps(len(FORMATS)) as steps:
        for name, (fn, target) in FORMATS.items():
            steps.step(f"{name}: quantize and amax pass, alternately x{args.repeats}")
            t_fn, t_ref = paired_best(partial(fn, x), ref, args.repeats)
            results.append((name, t_fn, t_ref, target))

    machine = this_machine().describe()
    shape = f"[{args.rows}, {args.cols}] bf16, best of {args.repeats}, timed alternately"
    table = titled_table(
        "quantize vs one x.float().abs().amax(-1) pass",
        shape,
        machine,
        ("format", "quantize ms", "amax pass ms", "ratio", "target", "status"),
    )
    ratios = [t / t_ref for _, t, t_ref, _ in results]
    for (name, t, t_ref, target), ratio in zip(results, ratios, strict=True):
        table.add_row(
            name,
            f"{t * 1e3:.1f}",
            f"{t_ref * 1e3:.1f}",
            target.fmt(ratio),
            target.label(),
            status(ratio, target),
        )
    out = console()
    out.print(table)
    met = sum(status(r, res[3]) == "ok" for r, res in zip(ratios, results, strict=True))
    out.print(f"{met}/{len(results)} formats within target")
    if not args.no_plot:
        fig, (ax,) = plots.figure(1, 1, width=11, height=4.8)
        plots.title(fig, "quantize time / one amax pass (lower is better)", shape, machine)
        shown = plots.ratio_bars(ax, [r[0] for r in results], ratios, [r[3] for r in results])
        ax.set_ylabel("quantize / amax pass")
        plots.status_legend(fig, shown)
        out.print(f"wrote {plots.save(fig, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

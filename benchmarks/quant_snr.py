"""SNR (dB) of every moe_ep.quant format's round trip on Gaussian data, table and bar chart.

    uv run python benchmarks/quant_snr.py [--rows 1024] [--cols 7168] [--seed 0]
        [--out benchmarks/out/quant_snr.png | --no-plot]

Measures SNR = 10 * log10(sum(x**2) / sum((dequant(quant(x)) - x)**2)) over a [rows, cols]
tensor of N(0, 1) values rounded to bf16 (the input the layer sees). The second figure puts
one 100-sigma outlier in every 128 elements and reports the SNR of the *other* (Gaussian)
elements: how much an outlier costs its neighbours, which is where scale granularity
matters. No target is stated for SNR (docs/runbook.md reports the figures; docs/quant.md
has the table), so the status column reads n/a.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

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
from moe_ep.bench.targets import status

Roundtrip = Callable[[torch.Tensor], torch.Tensor]
OUTLIER_EVERY = 128


def _nvfp4(x: torch.Tensor) -> torch.Tensor:
    nc = q.nvfp4_global_scale(x)
    return q.dequantize_nvfp4(*q.quantize_nvfp4(x, norm_const=nc), norm_const=nc)


FORMATS: dict[str, Roundtrip] = {
    "fp8 e4m3 per-tensor": lambda x: q.dequantize_fp8_per_tensor(*q.quantize_fp8_per_tensor(x)),
    "fp8 e5m2 per-tensor": lambda x: q.dequantize_fp8_per_tensor(
        *q.quantize_fp8_per_tensor(x, dtype=torch.float8_e5m2)
    ),
    "fp8 e4m3 per-row": lambda x: q.dequantize_fp8_per_row(*q.quantize_fp8_per_row(x)),
    "fp8 e4m3 1x128": lambda x: q.dequantize_fp8_blockwise(*q.quantize_fp8_blockwise(x)),
    "fp8 e4m3 1x128 ue8m0": lambda x: q.dequantize_fp8_blockwise(
        *q.quantize_fp8_blockwise(x, scale_format="ue8m0")
    ),
    "fp8 e4m3 128x128": lambda x: q.dequantize_fp8_blockwise(
        *q.quantize_fp8_blockwise(x, block=(128, 128)), block=(128, 128)
    ),
    "mxfp8 e4m3 ceil": lambda x: q.dequantize_mxfp8(*q.quantize_mxfp8(x)),
    "mxfp8 e4m3 ocp": lambda x: q.dequantize_mxfp8(*q.quantize_mxfp8(x, rule="ocp")),
    "mxfp8 e5m2 ceil": lambda x: q.dequantize_mxfp8(*q.quantize_mxfp8(x, dtype=torch.float8_e5m2)),
    "nvfp4 (global scale)": _nvfp4,
    "nvfp4 (norm_const=1)": lambda x: q.dequantize_nvfp4(*q.quantize_nvfp4(x)),
    "mxfp4 ceil": lambda x: q.dequantize_mxfp4(*q.quantize_mxfp4(x)),
    "mxfp4 ocp": lambda x: q.dequantize_mxfp4(*q.quantize_mxfp4(x, rule="ocp")),
}


def snr_db(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """10 log10 of signal over error energy of `y` against `x` (over `mask` if given)."""
    xd, yd = x.double(), y.double()
    if mask is not None:
        xd, yd = xd[mask], yd[mask]
    noise = (yd - xd).pow(2).sum()
    return float(10 * torch.log10(xd.pow(2).sum() / noise))


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help; the docstring as description."""
    parser = benchmark_parser(__doc__ or "")
    parser.add_argument("--rows", type=positive_int, default=1024, help="rows of the tensor")
    parser.add_argument(
        "--cols",
        type=positive_multiple_of(128),
        default=7168,
        help="columns of the tensor (a multiple of 128: the largest block)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the Gaussian data")
    add_plot_options(parser, OUT_DIR / "quant_snr.png")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.rows, args.cols, generator=g).bfloat16().float()
    xo = x.clone()
    xo[:, ::OUTLIER_EVERY] = 100.0
    rest = torch.ones_like(xo, dtype=torch.bool)
    rest[:, ::OUTLIER_EVERY] = False
    results: list[tuple[str, float, float]] = []
    with Steps(len(FORMATS)) as steps:
        for name, fn in FORMATS.items():
            steps.step(f"{name}: round trip, Gaussian and with outliers")
            results.append((name, snr_db(x, fn(x)), snr_db(xo, fn(xo), rest)))

    machine = this_machine().describe()
    shape = f"N(0,1) rounded to bf16, [{args.rows}, {args.cols}], seed {args.seed}"
    outlier = f"SNR dB of the rest, one 100-sigma outlier per {OUTLIER_EVERY}"
    table = titled_table(
        "moe_ep.quant round-trip SNR", shape, machine, ("format", "SNR dB", outlier, "status")
    )
    for name, s, so in results:
        table.add_row(name, f"{s:.2f}", f"{so:.2f}", status(s, None))
    out = console()
    out.print(table)
    if not args.no_plot:
        fig, (ax,) = plots.figure(1, 1, width=12, height=5)
        plots.title(
            fig, "round-trip SNR (higher is better; no target stated: reported)", shape, machine
        )
        plots.grouped_bars(
            ax,
            [r[0] for r in results],
            {
                "Gaussian": [r[1] for r in results],
                f"the others, with one\n100-sigma outlier per {OUTLIER_EVERY}": [
                    r[2] for r in results
                ],
            },
            lambda v: f"{v:.1f}",
            wrap=8,
        )
        ax.set_ylabel("SNR (dB)")
        out.print(f"wrote {plots.save(fig, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

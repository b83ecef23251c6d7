"""SNR (dB) of every moe_ep.quant format on Gaussian data, plus a bar chart.

Usage: uv run python benchmarks/quant_snr.py [--rows 1024] [--cols 7168] [--seed 0]
       [--out benchmarks/out/quant_snr.png]

SNR = 10 * log10(sum(x**2) / sum((dequant(quant(x)) - x)**2)) over a [rows, cols] tensor of
N(0, 1) values rounded to bf16 (the input the layer sees). The second column puts one 100-sigma
outlier in every 128 elements and reports the SNR of the *other* (Gaussian) elements: how much
an outlier costs its neighbours, which is where scale granularity matters.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

import moe_ep.quant as q

Roundtrip = Callable[[torch.Tensor], torch.Tensor]


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
    xd, yd = x.double(), y.double()
    if mask is not None:
        xd, yd = xd[mask], yd[mask]
    noise = (yd - xd).pow(2).sum()
    return float(10 * torch.log10(xd.pow(2).sum() / noise))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=7168)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/quant_snr.png"))
    args = parser.parse_args(argv)

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.rows, args.cols, generator=g).bfloat16().float()
    xo = x.clone()
    xo[:, ::128] = 100.0
    rest = torch.ones_like(xo, dtype=torch.bool)
    rest[:, ::128] = False
    results: list[tuple[str, float, float]] = []
    for name, fn in track(FORMATS.items(), description="quantizing", transient=True):
        results.append((name, snr_db(x, fn(x)), snr_db(xo, fn(xo), rest)))

    table = Table(title=f"SNR on N(0,1) bf16 [{args.rows}, {args.cols}], seed {args.seed}")
    for col in ("format", "SNR dB", "SNR dB of the rest, 100-sigma outlier / 128"):
        table.add_column(col)
    for name, s, so in results:
        table.add_row(name, f"{s:.2f}", f"{so:.2f}")
    console = Console()
    console.print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [r[0] for r in results]
    pos = range(len(names))
    ax.barh([p + 0.2 for p in pos], [r[1] for r in results], height=0.4, label="Gaussian")
    ax.barh(
        [p - 0.2 for p in pos],
        [r[2] for r in results],
        height=0.4,
        label="others, 1 outlier (100 sigma) per 128",
    )
    ax.set_yticks(list(pos), names)
    ax.invert_yaxis()
    ax.set_xlabel("SNR (dB)")
    ax.set_title("moe_ep.quant round-trip SNR")
    ax.legend(loc="lower right")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    console.print(f"chart: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The fused CPU expert GEMM alone, per stored weight format, against the machine's limits.

    uv run python benchmarks/expert_gemm_speed.py [--experts 16] [--n 2048] [--k 2048]
        [--rows 1 8 64] [--threads 1] [--reps 7] [--baseline-kernel OLD_cpu_fused.c]
        [--out benchmarks/out/expert_gemm_speed.png | --no-plot]

One `cpu_fused.expert_gemm` call over --experts experts of [--n, --k] weights (the layer's
FC1 shape at H = K, I = N / 2), --rows bf16 rows each, on the body the layer takes (the AMX
order for the formats exact in bf16 where the CPU has AMX; there fp8's block-scaled order on
the rows' codes, which the recipe's dispatch quantization gives, and on a --baseline-kernel
library without that order the fp32 order on the dequantized rows, as the layer would run
it), on the weights as the layer keeps them after quantizing the same Gaussian weights
(each recipe's stored form: bf16, fp8 128x128 fp32 scales, mxfp8, nvfp4, fp8_fp4's mxfp4:
real codes, so about as many subnormal ones as a trained layer's; or, where the layer packs
them for the k order by default, `experts.packs_by_default` on AVX2 CPUs, that packed copy:
the k-order body). Measured in one round robin (medians): the read bandwidth (streaming
`sum`), each format's limit (its stored bytes: codes and scales / that bandwidth, also
where the packed copy runs), an fp32 `mm` of equal FLOPs
(the machine's arithmetic, its weight shared), and, with --baseline-kernel, the library
built from another `cpu_fused.c` (an older commit's) on the same call.
Target (issue 16, quantized formats at decode): kernel / its own limit <= 2x, judged at
16 rows per expert or fewer (decode); bf16 and more rows (compute-bound) only reported.
Prints a table with a status column and plots kernel / limit by format and row count.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from benchlib import OUT_DIR, baseline_kernel
from benchlib.moe_peers import bandwidth
from benchlib.options import add_plot_options, benchmark_parser, positive_int

from moe_ep.backends.portable import cpu_fused, experts, recipes
from moe_ep.bench import plots
from moe_ep.bench.machine import this_machine
from moe_ep.bench.progress import Steps
from moe_ep.bench.tables import console, titled_table
from moe_ep.bench.targets import QUANT_VS_LIMIT, Target, status
from moe_ep.bench.timing import Samples, round_robin
from moe_ep.types import MoEWeightPack

DECODE_ROWS = 16  # the target applies at this many rows per expert or fewer
TARGET = Target(
    QUANT_VS_LIMIT.op, QUANT_VS_LIMIT.bound, applies_to=f"quantized, <= {DECODE_ROWS} rows"
)
RECIPES: dict[str, Callable[[], recipes.Recipe]] = {
    "bf16": recipes.Bf16Recipe,
    "fp8": recipes.Fp8BlockRecipe,
    "mxfp8": recipes.Mxfp8Recipe,
    "nvfp4": recipes.Nvfp4Recipe,
    "fp8_fp4": recipes.Fp8Fp4Recipe,
}
NOW, BASELINE, DENSE = "now", "baseline", "dense"


class Result(NamedTuple):
    fmt: str
    reads: str
    """the weights the kernel reads: stored, or packed bf16 / e4m3 (the layer's packed copy)"""
    rows: int
    nbytes: int
    limit_s: float
    dense: Samples
    now: Samples
    baseline: Samples | None

    @property
    def vs_limit(self) -> float:
        return self.now.median / self.limit_s

    @property
    def status(self) -> str:
        judged = self.fmt != "bf16" and self.rows <= DECODE_ROWS
        return status(self.vs_limit if judged else None, TARGET)


def rows_text(rows: int) -> str:
    return f"{rows} row{'' if rows == 1 else 's'} per expert"


class Stored(NamedTuple):
    weight: cpu_fused.StoredWeight | cpu_fused.PackedK16
    """the weight the layer's expert GEMM reads: the stored form, or its packed copy"""
    stored: cpu_fused.StoredWeight
    """the recipe's stored form (the limit's bytes)"""
    body: cpu_fused.Body | bool
    """the body the layer runs these experts on (`experts.amx_for_quantized`)"""
    recipe: recipes.Recipe
    """its `keeps_codes`: the layer hands the experts the rows' codes (fp8 on AMX)"""


def stored_weights(n_experts: int, n: int, k: int) -> dict[str, Stored]:
    """Each format's FC1 weight as the layer keeps it (stored, or packed where the layer
    packs by default), from the same Gaussian weights, with the body the layer takes."""
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(n_experts, n, k, generator=g) / k**0.5).bfloat16()
    w2 = (torch.randn(n_experts, k, n // 2, generator=g) / (n // 2) ** 0.5).bfloat16()
    cpu = torch.device("cpu")
    out = {}
    for fmt, recipe in RECIPES.items():
        prepared = recipe().prepare(MoEWeightPack(w13, w2))
        if prepared.stored13 is None:
            raise RuntimeError(f"{fmt}: the recipe keeps no stored-width weight on CPU")
        body: cpu_fused.Body | bool = "amx" if experts.amx_for_quantized(prepared, cpu) else True
        run: cpu_fused.StoredWeight | cpu_fused.PackedK16 | None = prepared.stored13
        if experts.packs_by_default(prepared, cpu, experts.expert_gemm_rows(prepared, cpu)):
            run = experts.prepack(prepared).kpack13
        assert run is not None
        out[fmt] = Stored(run, prepared.stored13, body, recipe())
    return out


def _gemm(
    x: torch.Tensor,
    codes: cpu_fused.E4m3Rows | None,
    groups: cpu_fused.ExpertGroups,
    w: cpu_fused.StoredWeight | cpu_fused.PackedK16,
    out: torch.Tensor,
    scratch: torch.Tensor,
    vector: cpu_fused.Body | bool,
) -> None:
    """The call the layer makes: on the rows' codes in the block-scaled order where it has
    them and the library that order (`codes`), else on the (dequantized) rows x."""
    if codes is not None and cpu_fused.expert_gemm(
        codes.codes, None, groups, w, out, scratch, vector="amx", x_scales=codes.scales,
        x_block=codes.block,
    ):  # fmt: skip
        return
    if not cpu_fused.expert_gemm(x, None, groups, w, out, scratch, vector=vector):
        raise RuntimeError("the fused CPU expert GEMM is unavailable here")


def measure(args: argparse.Namespace, steps: Steps, bw: float) -> list[Result]:
    base = None if args.baseline_kernel is None else baseline_kernel.build(args.baseline_kernel)
    weights = stored_weights(args.experts, args.n, args.k)
    results = []
    for rows in args.rows:
        q_start = torch.arange(args.experts + 1, dtype=torch.int64) * rows
        groups = cpu_fused.ExpertGroups(q_start, torch.arange(args.experts), q_start[:-1].clone())
        x = torch.randn(args.experts * rows, args.k).bfloat16()
        out = torch.empty(args.experts * rows, args.n)
        scratch = torch.empty(cpu_fused.expert_gemm_scratch(args.experts * rows, args.k))
        xf, wf = x.float(), torch.randn(args.k, args.n)
        dense_out = torch.empty_like(out)
        for fmt, (w, stored, body, recipe) in weights.items():
            steps.step(f"{fmt}, {rows_text(rows)}")
            rows_x, codes = x, None
            if recipe.keeps_codes(x.device):
                payload = recipe.pack(x)
                rows_x, codes = recipe.unpack(payload, args.k), recipe.codes_of(payload, args.k)
            call = partial(_gemm, rows_x, codes, groups, w, out, scratch, body)
            fns: dict[str, Callable[[], object]] = {
                NOW: call,
                DENSE: partial(torch.mm, xf, wf, out=dense_out),
            }
            if base is not None:
                fns[BASELINE] = baseline_kernel.with_library(base, call)
            t = round_robin(fns, args.reps)
            nbytes = stored.nbytes(args.experts)
            reads = f"packed {w.code}" if isinstance(w, cpu_fused.PackedK16) else "stored"
            results.append(
                Result(fmt, reads, rows, nbytes, nbytes / bw, t[DENSE], t[NOW], t.get(BASELINE))
            )
    return results


def print_table(results: list[Result], args: argparse.Namespace, machine: str, bw: float) -> None:
    cols = ["format", "reads", "rows/expert", "stored MiB", "limit ms", "dense fp32 ms"]
    cols += ["kernel ms"]
    cols += ["baseline ms", "baseline/kernel"] if args.baseline_kernel else []
    cols += ["kernel/limit", "kernel/dense", "status"]
    table = titled_table(
        "fused CPU expert GEMM by stored format",
        f"E={args.experts} N={args.n} K={args.k}, read bandwidth {bw / 1e9:.1f} GB/s",
        machine,
        cols,
        caption=f"limit = stored bytes (codes and scales) / read bandwidth; reads: the weights "
        "the layer's expert GEMM reads (its packed copy where it packs by default); target: "
        f"quantized kernel/limit {TARGET.label()} at <= {DECODE_ROWS} rows per expert",
    )
    for r in results:
        cells = [r.fmt, r.reads, str(r.rows), f"{r.nbytes / 2**20:.0f}", f"{r.limit_s * 1e3:.2f}"]
        cells += [f"{r.dense.median * 1e3:.2f}", f"{r.now.median * 1e3:.2f} ({r.now.spread()})"]
        if args.baseline_kernel:
            b = r.baseline
            cells += ["-", "-"] if b is None else [
                f"{b.median * 1e3:.2f} ({b.spread()})", f"{b.median / r.now.median:.2f}x"
            ]  # fmt: skip
        cells += [f"{r.vs_limit:.2f}x", f"{r.now.median / r.dense.median:.2f}x", r.status]
        table.add_row(*cells)
    console().print(table)


def plot(results: list[Result], args: argparse.Namespace, machine: str, path: Path) -> Path:
    fig, (ax,) = plots.figure(1, 1, width=9, height=4.8)
    fmts = list(dict.fromkeys(r.fmt for r in results))
    series = {
        rows_text(rows): [next(r.vs_limit for r in results if (r.fmt, r.rows) == (f, rows))
                                for f in fmts]
        for rows in args.rows
    }  # fmt: skip
    plots.grouped_bars(ax, fmts, series, lambda v: f"{v:.1f}x")
    plots.target_line(ax, TARGET, -0.5, len(fmts) - 0.5)
    ax.set_ylabel("kernel time / own weight-bytes limit")
    plots.title(
        fig, "fused CPU expert GEMM against its read-bandwidth limit",
        f"E={args.experts} N={args.n} K={args.k}", machine,
    )  # fmt: skip
    return plots.save(fig, path)


def build_parser() -> argparse.ArgumentParser:
    parser = benchmark_parser(__doc__ or "")
    parser.add_argument("--experts", type=positive_int, default=16, help="experts in the call")
    parser.add_argument("--n", type=positive_int, default=2048, help="weight rows (outputs)")
    parser.add_argument(
        "--k", type=positive_int, default=2048, help="weight columns (inputs); a multiple of 128"
    )
    parser.add_argument(
        "--rows", type=positive_int, nargs="+", default=[1, 8, 64], help="rows per expert"
    )
    parser.add_argument("--threads", type=positive_int, default=1, help="intra-op threads")
    parser.add_argument("--reps", type=positive_int, default=7, help="timed runs of each")
    parser.add_argument(
        "--baseline-kernel", type=Path, help="also time the library built from this cpu_fused.c"
    )
    add_plot_options(parser, OUT_DIR / "expert_gemm_speed.png")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.k % 128 or args.n % 128:
        parser.error(f"--n and --k must be multiples of 128 (the formats' blocks), got "
                     f"{args.n} and {args.k}")  # fmt: skip
    if args.baseline_kernel is not None and not args.baseline_kernel.is_file():
        parser.error(f"--baseline-kernel {args.baseline_kernel}: no such file")
    if cpu_fused.library() is None:
        parser.error(f"no fused CPU library here: {cpu_fused._no_compiler_reason()}")
    torch.set_num_threads(args.threads)
    machine = this_machine([args.threads]).describe()
    with Steps(1 + len(args.rows) * len(RECIPES)) as steps:
        steps.step("read bandwidth")
        bw = bandwidth(5)
        results = measure(args, steps, bw)
    print_table(results, args, machine, bw)
    if not args.no_plot:
        print(f"plot: {plot(results, args, machine, args.out)}")


if __name__ == "__main__":
    main()

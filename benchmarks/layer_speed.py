"""Speed and memory of the portable bf16 layer at EP1 on CPU, as ratios from one run.

    uv run python benchmarks/layer_speed.py [--reps 5] [--threads 1 2]
        [--prefill T,H,I,E,k] [--decode T,H,I,E,k] [--stages]
        [--sections layer peers crossover] [--peer-shapes NAME ...]
        [--baseline-kernel OLD_cpu_fused.c] [--cpu-prepacked-weights]
        [--out benchmarks/out/layer_speed.png | --no-plot]

Measures one `MoEEpLayer` forward (`any_bf16_bf16_bf16_torch`, world size 1) against
  - dense matmuls doing the same useful FLOPs (`[T*k, H] @ [H, 2I]` and
    `[T*k, I] @ [I, H]` into preallocated outputs, bf16 and fp32: the faster is the
    machine's limit, as in the peers section); target
    layer / dense <= 1.3x on the prefill shape (none stated for decode);
  - a naive per-expert loop with the layer's math (gather, gate / up / down matmuls, SwiGLU
    in fp32, weighted fp32 index_add): target naive / layer > 1x, on the prefill shape and
    on the decode-like shape;
  - the same layer with the fused CPU library switched off, as with MOE_EP_CPU_FUSED=0
    (eager torch SwiGLU and combine, and at 2+ threads each GEMM split over the threads
    instead of one-thread expert blocks side by side; `moe_ep.backends.portable.cpu_fused`),
    to show what it buys (reported);
  - for reference, the same loop all in bf16 (SwiGLU, weighting and index_add in bf16, as
    common eager MoE code does; fewer passes, less accurate; reported);
and the resident memory a prefill forward adds against inputs + outputs + one copy of the
dispatched activations (target < 2x), once for the first forward of a fresh layer (which
allocates the reusable workspace) and once for a warm forward. Times are the minimum over
--reps runs measured round-robin (the box is shared; the minimum is the least disturbed),
for each intra-op thread count of --threads in the same run. --stages adds where a prefill
forward's time goes (expert GEMMs, SwiGLU, gathers, combine, the rest), at 1 thread in
thread CPU time (less moved by other jobs on a shared box than wall time), minimum over
--reps forwards. Tables carry a status column (ok / over target / under target / n/a);
the plot shows every ratio against its target line.

--sections peers (issue 16; at the last --threads count, medians of --reps round-robin runs
with their min-max) measures in one run the machine's read bandwidth (a 1 GiB streaming
read, before and after the timings; the limits use the faster of the two), each shape's
bandwidth limit (the active experts' bf16 weight bytes / bandwidth),
dense GEMMs of equal FLOPs (bf16 and fp32: the faster is "dense"), the naive loop and
Hugging Face transformers' Qwen3-MoE experts block on the same weights and routing, each
`experts_implementation` that runs on CPU
(eager, batched_mm, grouped_mm; needs the optional `bench` group: `uv sync --group bench`,
else skipped with the reason), on --peer-shapes (default: all of prefill, T=512, decode
T=64 / 16 / 4 / 1, DeepSeek-like I/8), and the quantized formats' layers at decode T=64
against their own stored weight bytes. Targets: decode T=64 layer <= 1.5x its limit and
>= 2x faster than the peer's fastest, every shape no slower than it, T=512 <= 1.2x dense,
prefill <= 1.1x dense, quantized decode <= 2x their limit. --sections crossover times
`run_experts` with every expert on the CPU expert GEMM of few rows and on the `mm` blocks,
by rows per expert (bf16, mxfp8). Their plot goes to the --out name with `_peers` added.
--baseline-kernel PATH (with peers) times the layers once more on the fused CPU library
built from another cpu_fused.c (e.g. `git show 0f2f303:<its path> > old.c`), in the same
round robin: before / after a kernel change measured side by side under the same load.
--cpu-prepacked-weights (with peers or crossover) also times the bf16 layer with
`cpu_prepacked_weights=True` in the same round robin ("layer prepacked", reported; the
judged ratios stay the default layer's), the quantized formats' layers with
`cpu_prepacked_weights=False` where their default packs ("layer unpacked": on CPUs
without oneDNN bf16 GEMMs, every quantized format, fp8 as its codes), and the
crossover on the prepacked weights (bf16's `mm` blocks where torch has
oneDNN's bf16 GEMMs, else the expert GEMM's k order, bf16 and mxfp8); refused where
neither applies.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from benchlib import OUT_DIR, baseline_kernel, moe_peers
from benchlib.options import add_plot_options, benchmark_parser, moe_shape, positive_int, shape_text
from rich.console import Console

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable import comm, cpu_fused, experts
from moe_ep.bench import limits, plots
from moe_ep.bench.machine import this_machine
from moe_ep.bench.progress import Steps
from moe_ep.bench.tables import console, titled_table
from moe_ep.bench.targets import Target, row_status, status
from moe_ep.registry import get_kernel
from moe_ep.spawn import free_port

PREFILL = {"T": 4096, "H": 2048, "I": 1024, "E": 16, "k": 4}
DECODE = {"T": 64, "H": 2048, "I": 1024, "E": 64, "k": 8}
# The targets docs/runbook.md states (layer.md "Benchmarks" has the history).
LAYER_VS_DENSE = Target("<=", 1.3, applies_to="prefill")
NAIVE_VS_LAYER = Target(">", 1.0)
RSS_VS_REFERENCE = Target("<", 2.0)


def best_of(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Minimum time of each fn, measured round-robin so load drifts hit all alike."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for j, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[j] = min(best[j], time.perf_counter() - start)
    return best


def problem(shape: dict[str, int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = shape["T"], shape["H"], shape["I"], shape["E"], shape["k"]
    return {
        "x": torch.randn(t, h, generator=g).bfloat16(),
        "ids": torch.rand(t, e, generator=g).topk(k, dim=1).indices,
        "w": torch.softmax(torch.randn(t, k, generator=g), dim=1),
        "w13": (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16(),
        "w2": (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16(),
    }


def naive_forward(p: dict[str, torch.Tensor]) -> torch.Tensor:
    """The naive per-expert loop (`moe_ep.bench.limits.naive_forward`) on `problem`'s dict."""
    return limits.naive_forward(p["x"], p["ids"], p["w"], p["w13"], p["w2"])


def naive_bf16_forward(p: dict[str, torch.Tensor]) -> torch.Tensor:
    """The same loop all in bf16 (SwiGLU, weighting, index_add), as in common eager code."""
    x, ids, w = p["x"], p["ids"], p["w"]
    inter = p["w2"].shape[2]
    out = torch.zeros_like(x)
    for e in range(p["w13"].shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = F.silu(xe @ p["w13"][e, :inter].t()) * (xe @ p["w13"][e, inter:].t())
        y = h @ p["w2"][e].t()
        out.index_add_(0, tok, y * w[tok, slot].unsqueeze(1).bfloat16())
    return out


def make_layer(
    p: dict[str, torch.Tensor],
    shape: dict[str, int],
    kernel_name: str = "any_bf16_bf16_bf16_torch",
    prepacked: bool | None = None,
) -> MoEEpLayer:
    """A world-size-1 layer on `p`'s weights with `cpu_prepacked_weights=prepacked` (None:
    the default; True refused, with the reason, where the kernel or this CPU cannot
    prepack)."""
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    fleet = FleetParams(shape["E"], shape["T"], shape["H"])
    kernel: Any = kernel_name
    if prepacked is not None:
        kernel = get_kernel(kernel_name).config_cls(cpu_prepacked_weights=prepacked)
    return MoEEpLayer(boot, fleet, MoEWeightPack(p["w13"], p["w2"]), kernel)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_during(fn: Callable[[], object]) -> int:
    """Peak resident bytes above the level before `fn`, sampled every 0.2 ms."""
    base = rss_bytes()
    peak = base
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_bytes())
            time.sleep(0.0002)

    th = threading.Thread(target=sample)
    th.start()
    try:
        fn()
    finally:
        stop.set()
        th.join()
    return max(peak, rss_bytes()) - base


def eager_epilogues(fn: Callable[[], object]) -> object:
    """Run `fn` with the fused CPU library switched off (as MOE_EP_CPU_FUSED=0: eager SwiGLU /
    combine, GEMMs split over the intra-op threads)."""
    saved = cpu_fused.library
    cpu_fused.library = lambda: None
    try:
        return fn()
    finally:
        cpu_fused.library = saved


def dense_pair(shape: dict[str, int]) -> tuple[Callable[[], object], Callable[[], object]]:
    """The bf16 and the fp32 dense GEMMs of the shape's useful FLOPs: the faster is the
    machine's limit (on CPUs without bf16 GEMM kernels torch's bf16 `mm` is a slow fallback,
    so bf16 alone would flatter the layer)."""
    m, h, i = shape["T"] * shape["k"], shape["H"], shape["I"]
    return limits.dense_gemms(m, h, i, torch.bfloat16), limits.dense_gemms(m, h, i, torch.float32)


def time_shape(shape: dict[str, int], reps: int) -> dict[str, float | bool]:
    """Round-robin minimum times (s) of the layer and the baselines on one shape."""
    p = problem(shape)
    layer = make_layer(p, shape)
    tensors = MoEEpTensors(p["x"], p["ids"], p["w"])
    dense16, dense32 = dense_pair(shape)
    t_layer, t_eager, t_dense16, t_dense32, t_naive, t_naive16 = best_of(
        [
            lambda: layer(tensors),
            lambda: eager_epilogues(lambda: layer(tensors)),
            dense16,
            dense32,
            lambda: naive_forward(p),
            lambda: naive_bf16_forward(p),
        ],
        reps,
    )
    t_dense = min(t_dense16, t_dense32)
    same = torch.equal(layer(tensors), layer(tensors))
    layer.destroy()
    return {
        "layer": t_layer,
        "eager": t_eager,
        "dense": t_dense,
        "naive": t_naive,
        "naive16": t_naive16,
        "same": same,
    }


def memory(shape: dict[str, int]) -> tuple[int, int, int]:
    """(bytes added by a fresh layer's first forward, by a warm forward, reference bytes)."""
    p = problem(shape)
    layer = make_layer(p, shape)
    tensors = MoEEpTensors(p["x"], p["ids"], p["w"])
    first = peak_rss_during(lambda: layer(tensors))
    warm = peak_rss_during(lambda: layer(tensors))
    layer.destroy()
    t, h, k = shape["T"], shape["H"], shape["k"]
    reference = 2 * t * h + 2 * t * h + 2 * t * k * h + 12 * t * k
    return first, warm, reference


@contextmanager
def _stage_timers(acc: dict[str, float]) -> Iterator[None]:
    """Accumulate thread CPU time of the portable kernel's stages into `acc` (patched in)."""
    patched: list[tuple[Any, str, Any]] = []

    def wrap(mod: Any, name: str, key: str) -> None:
        fn = getattr(mod, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] = acc.get(key, 0.0) + time.thread_time() - start

        patched.append((mod, name, fn))
        setattr(mod, name, timed)

    wrap(experts, "_mm", "expert GEMMs")
    wrap(cpu_fused, "expert_gemm", "expert GEMMs")  # experts of few rows (FC1 and FC2)
    wrap(experts, "_swiglu", "SwiGLU")
    wrap(experts, "run_experts", "experts total")
    wrap(comm, "combine", "combine")
    try:
        yield
    finally:
        for mod, name, fn in reversed(patched):
            setattr(mod, name, fn)


def stages(shape: dict[str, int], reps: int) -> dict[str, float]:
    """Minimum thread CPU seconds per stage of a forward on `shape` at 1 thread, and of the
    faster of the bf16 and fp32 dense GEMMs of the same useful FLOPs ("dense")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    p = problem(shape)
    layer = make_layer(p, shape)
    tensors = MoEEpTensors(p["x"], p["ids"], p["w"])
    layer(tensors)
    best: dict[str, float] = {}
    try:
        for _ in range(reps):
            acc: dict[str, float] = {}
            with _stage_timers(acc):
                start = time.thread_time()
                layer(tensors)
                acc["forward"] = time.thread_time() - start
            for key, v in acc.items():
                best[key] = min(best.get(key, float("inf")), v)
    finally:
        layer.destroy()
        torch.set_num_threads(threads)
    torch.set_num_threads(1)
    try:
        for _ in range(reps):
            for dense in dense_pair(shape):
                start = time.thread_time()
                dense()
                best["dense"] = min(best.get("dense", float("inf")), time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return best


def stage_rows(best: dict[str, float]) -> list[tuple[str, str, float]]:
    """(stage, short name, seconds) rows of a prefill forward, the forward and the dense
    GEMMs last."""
    gemm, swiglu = best.get("expert GEMMs", 0.0), best.get("SwiGLU", 0.0)
    rest = best["forward"] - best["experts total"] - best["combine"]
    return [
        ("expert GEMMs (FC1 + FC2: mm blocks, expert GEMM)", "GEMMs", gemm),
        ("SwiGLU (widen, silu, multiply, round)", "SwiGLU", swiglu),
        ("expert gathers + loop", "gathers", best["experts total"] - gemm - swiglu),
        ("combine (gather, widen, weight, slot sum)", "combine", best["combine"]),
        ("plan, dispatch, bookkeeping", "other", rest),
        ("forward", "forward", best["forward"]),
        ("dense GEMMs (same useful FLOPs, faster of bf16 / fp32)", "dense", best["dense"]),
    ]


def print_stages(
    out: Console, rows: list[tuple[str, str, float]], shape: str, machine: str
) -> None:
    forward, dense = rows[-2][2], rows[-1][2]
    table = titled_table(
        "prefill forward by stage, 1 thread, thread CPU time (min over reps); no targets",
        shape,
        machine,
        ("stage", "ms", "share of forward", "x dense GEMMs", "status"),
    )
    for name, _, v in rows:
        table.add_row(
            name, f"{v * 1e3:.1f}", f"{v / forward:.0%}", f"{v / dense:.2f}", status(v, None)
        )
    out.print(table)


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help; the docstring as description."""
    parser = benchmark_parser(__doc__ or "")
    parser.add_argument(
        "--reps",
        type=positive_int,
        default=5,
        help="timed runs of each, round-robin; the minimum counts",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        nargs="+",
        default=[1, 2],
        help="intra-op thread counts to measure, each in the same run; memory is measured at "
        "the first",
    )
    parser.add_argument(
        "--prefill",
        type=moe_shape,
        default=",".join(str(v) for v in PREFILL.values()),
        metavar="T,H,I,E,k",
        help="the prefill shape: tokens, hidden, intermediate, experts, top-k",
    )
    parser.add_argument(
        "--decode",
        type=moe_shape,
        default=",".join(str(v) for v in DECODE.values()),
        metavar="T,H,I,E,k",
        help="the decode-like shape: tokens, hidden, intermediate, experts, top-k",
    )
    parser.add_argument(
        "--stages",
        action="store_true",
        help="also measure where the prefill forward's time goes (1 thread, thread CPU time)",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=("layer", "peers", "crossover"),
        default=["layer"],
        help="layer: the tables above; peers: issue 16's comparison (read bandwidth, "
        "bandwidth limit, dense, naive, transformers' experts, quantized formats at decode) "
        "on --peer-shapes; crossover: run_experts' expert GEMM vs mm blocks by rows per "
        "expert. peers / crossover plot to the --out name with _peers before the suffix",
    )
    parser.add_argument(
        "--peer-shapes",
        nargs="+",
        choices=tuple(moe_peers.PEER_SHAPES),
        default=list(moe_peers.PEER_SHAPES),
        metavar="NAME",
        help=f"shapes of the peers section, of: {', '.join(moe_peers.PEER_SHAPES)}",
    )
    parser.add_argument(
        "--baseline-kernel",
        type=Path,
        metavar="PATH",
        help="with --sections peers: also time the layers on the fused CPU library built "
        "from this cpu_fused.c (an older commit's), in the same round robin",
    )
    parser.add_argument(
        "--cpu-prepacked-weights",
        action="store_true",
        help="with --sections peers / crossover: also time the bf16 layer (and the crossover's "
        "bf16 mm blocks, or its expert GEMM where torch has no oneDNN bf16 GEMMs) with "
        "cpu_prepacked_weights=True, and the quantized layers whose default packs with "
        "cpu_prepacked_weights=False, in the same round robin",
    )
    add_plot_options(parser, OUT_DIR / "layer_speed.png")
    return parser


def run_peers(args: argparse.Namespace) -> None:
    """The peers / crossover sections at the last --threads count."""
    threads = args.threads[-1]
    torch.set_num_threads(threads)
    shapes = args.peer_shapes if "peers" in args.sections else []
    results, quant, points = [], [], []
    baseline = None if args.baseline_kernel is None else baseline_kernel.build(args.baseline_kernel)
    with Steps(2 + len(shapes) + ("crossover" in args.sections)) as steps:
        steps.step(f"read bandwidth, {threads} thread(s)")
        bw = moe_peers.bandwidth(max(args.reps, 5))
        for name in shapes:
            shape = moe_peers.PEER_SHAPES[name]
            steps.step(
                f"{name} {shape_text(shape)}: layer, dense, naive, transformers x{args.reps}"
            )
            results.append(
                moe_peers.time_peer_shape(
                    name,
                    shape,
                    args.reps,
                    bw,
                    problem,
                    make_layer,
                    naive_forward,
                    baseline,
                    args.cpu_prepacked_weights,
                )
            )
        steps.step("quantized formats at decode")
        if "peers" in args.sections:
            decode = moe_peers.PEER_SHAPES[moe_peers.DECODE_TARGETED]
            quant = moe_peers.time_quantized(
                decode, args.reps, bw, problem, make_layer, baseline, args.cpu_prepacked_weights
            )
        if "crossover" in args.sections:
            steps.step("crossover: expert GEMM vs mm blocks by rows per expert")
            points = moe_peers.crossover(args.reps, prepacked=args.cpu_prepacked_weights)
        bw_after = moe_peers.bandwidth(max(args.reps, 5))
    # the limits at the faster of the two reads (a neighbour's load slows them): the
    # stricter limit, so that a busy moment at the first read never meets a target
    best = max(bw, bw_after)
    results = [dataclasses.replace(r, limit_s=r.limit_s * bw / best) for r in results]
    quant = [dataclasses.replace(q, limit_s=q.limit_s * bw / best) for q in quant]
    machine = this_machine([threads]).describe()
    out = console()
    out.print(
        f"read bandwidth: {bw / 1e9:.1f} GB/s before, {bw_after / 1e9:.1f} GB/s after; "
        f"limits at {best / 1e9:.1f} GB/s"
    )
    bw = best
    if results:
        moe_peers.print_peers(out, results, quant, bw, machine, args.reps)
    if points:
        moe_peers.print_crossover(out, points, machine)
    if not args.no_plot:
        path = args.out.with_name(args.out.stem + "_peers" + args.out.suffix)
        line = f"median of {args.reps} runs, read bandwidth {bw / 1e9:.1f} GB/s"
        out.print(f"wrote {moe_peers.plot_peers(results, quant, points, line, machine, path)}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.baseline_kernel is not None:
        if "peers" not in args.sections:
            parser.error("--baseline-kernel times the peers section: add --sections peers")
        if not args.baseline_kernel.is_file():
            parser.error(f"--baseline-kernel {args.baseline_kernel}: no such file")
    if args.cpu_prepacked_weights:
        if not {"peers", "crossover"} & set(args.sections):
            parser.error("--cpu-prepacked-weights times the peers / crossover sections: add one")
        why = experts.prepack_host_unavailable(torch.device("cpu"))
        if why is not None:
            parser.error(f"--cpu-prepacked-weights cannot apply here: {why}")
    if "peers" in args.sections or "crossover" in args.sections:
        run_peers(args)
    if "layer" not in args.sections:
        return 0
    shapes = (("prefill", args.prefill), ("decode", args.decode))
    rows = []
    with Steps(1 + len(args.threads) * len(shapes) + args.stages) as steps:
        torch.set_num_threads(args.threads[0])
        steps.step(f"memory: prefill {shape_text(args.prefill)}, {args.threads[0]} thread(s)")
        mem = memory(args.prefill)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, shape in shapes:
                steps.step(
                    f"{name} {shape_text(shape)}, {threads} thread(s): layer and baselines "
                    f"round-robin x{args.reps}"
                )
                rows.append((name, shape, threads, time_shape(shape, args.reps)))
        if args.stages:
            steps.step(f"stages: prefill {shape_text(args.prefill)}, 1 thread, x{args.reps}")
            stage_times = stage_rows(stages(args.prefill, args.reps))

    machine = this_machine(args.threads).describe()
    shape_line = "; ".join(f"{n} {shape_text(sh)}" for n, sh in shapes) + (
        f"; bf16, EP1, min of {args.reps} round-robin reps"
    )
    table = titled_table(
        "portable bf16 layer vs dense GEMMs and a naive loop",
        shape_line,
        machine,
        (
            "shape",
            "threads",
            "layer",
            "dense GEMMs",
            "naive loop",
            "layer/dense",
            "eager/layer",
            "naive/layer",
            "bf16 loop/layer",
            "GFLOP/s",
            "status",
        ),
        caption=f"dense = the faster of the bf16 and fp32 GEMMs of equal FLOPs; targets "
        f"(docs/runbook.md): layer/dense {LAYER_VS_DENSE.label()} on prefill, "
        f"naive/layer {NAIVE_VS_LAYER.label()}; eager = the layer with eager epilogues "
        "(MOE_EP_CPU_FUSED=0), bf16 loop = the naive loop all in bf16: reported",
    )
    for name, sh, threads, r in rows:
        flops = 6 * sh["T"] * sh["k"] * sh["H"] * sh["I"]
        vs_dense, vs_naive = r["layer"] / r["dense"], r["naive"] / r["layer"]
        table.add_row(
            name,
            str(threads),
            f"{r['layer'] * 1e3:.1f} ms",
            f"{r['dense'] * 1e3:.1f} ms",
            f"{r['naive'] * 1e3:.1f} ms",
            f"{vs_dense:.2f}x",
            f"{r['eager'] / r['layer']:.2f}x",
            f"{vs_naive:.2f}x",
            f"{r['naive16'] / r['layer']:.2f}x",
            f"{flops / r['layer'] / 1e9:.1f}",
            row_status(
                (
                    ("layer/dense", vs_dense, LAYER_VS_DENSE if name == "prefill" else None),
                    ("naive/layer", vs_naive, NAIVE_VS_LAYER),
                )
            ),
        )
    out = console()
    out.print(table)
    first, warm, ref = mem
    mem_table = titled_table(
        "RSS added by a prefill forward",
        f"prefill {shape_text(args.prefill)}",
        this_machine(args.threads[:1]).describe(),
        ("forward", "MiB", "x reference", "target", "status"),
        caption=f"reference: inputs + outputs + one copy of the dispatched activations "
        f"({ref / 2**20:.0f} MiB); RSS sampled every 0.2 ms, so approximate",
    )
    mem_rows = (
        ("first forward of a fresh layer (allocates the workspace)", first),
        ("warm forward", warm),
    )
    for name, nbytes in mem_rows:
        mem_table.add_row(
            name,
            f"{nbytes / 2**20:.0f}",
            f"{nbytes / ref:.2f}x",
            RSS_VS_REFERENCE.label(),
            status(nbytes / ref, RSS_VS_REFERENCE),
        )
    out.print(mem_table)
    out.print(f"bit-identical across two forwards: {all(r[3]['same'] for r in rows)}")
    if args.stages:
        print_stages(
            out, stage_times, f"prefill {shape_text(args.prefill)}", this_machine([1]).describe()
        )
    if not args.no_plot:
        fig, axes = plots.figure(
            2, 3 if args.stages else 2, width=15 if args.stages else 11, height=8
        )
        plots.title(
            fig, "portable bf16 layer, EP1, CPU: ratios against targets", shape_line, machine
        )
        names = [f"{n}\n{t} thr\n{r['layer'] * 1e3:.1f} ms" for n, _, t, r in rows]
        shown = plots.ratio_bars(
            axes[0],
            names,
            [r["layer"] / r["dense"] for *_, r in rows],
            [LAYER_VS_DENSE if n == "prefill" else None for n, *_ in rows],
        )
        axes[0].set_title("layer / dense GEMMs of the same FLOPs (lower is better)", fontsize=9)
        shown += plots.ratio_bars(
            axes[1],
            names,
            [r["naive"] / r["layer"] for *_, r in rows],
            [NAIVE_VS_LAYER] * len(rows),
        )
        axes[1].set_title("speed-up over the naive per-expert loop (higher is better)", fontsize=9)
        reported = axes[3 if args.stages else 2]
        plots.grouped_bars(
            reported,
            names,
            {
                "eager-epilogue layer / layer": [r["eager"] / r["layer"] for *_, r in rows],
                "naive all-bf16 loop / layer": [r["naive16"] / r["layer"] for *_, r in rows],
            },
            lambda v: f"{v:.2f}x",
        )
        reported.set_title("reported, no target (> 1x: the layer is faster)", fontsize=9)
        shown += plots.ratio_bars(
            axes[2 if args.stages else 3],
            [f"{name.split(' (')[0]}\n{nbytes / 2**20:.0f} MiB" for name, nbytes in mem_rows],
            [nbytes / ref for _, nbytes in mem_rows],
            [RSS_VS_REFERENCE] * len(mem_rows),
            wrap=30,
        )
        axes[2 if args.stages else 3].set_title(
            f"RSS added / inputs + outputs + dispatched copy ({ref / 2**20:.0f} MiB), "
            f"{args.threads[0]} thr",
            fontsize=9,
        )
        if args.stages:
            forward, dense = stage_times[-2][2], stage_times[-1][2]
            grid = axes[4].get_gridspec()
            assert grid is not None  # made by plots.figure's subplots
            axes[4].remove()
            axes[5].remove()
            axes[4] = fig.add_subplot(grid[1, 1:])  # the stages get the row's last two slots
            plots.ratio_bars(
                axes[4],
                [short for _, short, _ in stage_times],
                [v / dense for *_, v in stage_times],
                [None] * len(stage_times),
                fmt=lambda v: f"{v:.2f}x",
            )
            axes[4].set_title(
                f"prefill stages / dense GEMMs, 1 thr, thread CPU time (forward "
                f"{forward * 1e3:.0f} ms)",
                fontsize=9,
            )
            del axes[5]
        for ax in axes:
            ax.set_ylabel("ratio")
        plots.status_legend(fig, shown)
        out.print(f"wrote {plots.save(fig, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

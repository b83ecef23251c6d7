"""Speed and memory of the portable bf16 layer at EP1 on CPU, as ratios from one run.

    uv run python benchmarks/layer_speed.py [--reps 5] [--threads 1 2] [--plot] [--stages]

Compares one `MoEEpLayer` forward (`any_bf16_bf16_bf16_torch`, world size 1) with
  - dense bf16 matmuls doing the same useful FLOPs (`[T*k, H] @ [H, 2I]` and
    `[T*k, I] @ [I, H]` into preallocated outputs): the machine's limit; target
    layer / dense <= 1.3;
  - a naive per-expert loop with the layer's math (gather, gate / up / down matmuls, SwiGLU
    in fp32, weighted fp32 index_add): target > 1x speed-up, on the prefill shape and on a
    decode-like shape;
  - the same layer with the fused CPU library switched off, as with MOE_EP_CPU_FUSED=0
    (eager torch SwiGLU and combine, and at 2+ threads each GEMM split over the threads
    instead of one-thread expert blocks side by side; `moe_ep.backends.portable.cpu_fused`),
    to show what it buys;
  - for reference, the same loop all in bf16 (SwiGLU, weighting and index_add in bf16, as
    common eager MoE code does; fewer passes, less accurate);
and reports the resident memory a forward adds against inputs + outputs + one copy of the
dispatched activations (target < 2x), once for the first forward of a fresh layer (which
allocates the reusable workspace) and once for a warm forward. Times are the minimum over
`--reps` runs measured round-robin (the box is shared; the minimum is the least disturbed),
for each intra-op thread count of `--threads` (default 1 and 2) in the same run.
`--stages` adds where a prefill forward's time goes (expert GEMMs, SwiGLU, gathers, combine,
the rest), at 1 thread in thread CPU time (less moved by other jobs on a shared box than
wall time), minimum over `--reps` forwards.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable import comm, cpu_fused, experts, kernel
from moe_ep.launch import free_port

PREFILL = {"T": 4096, "H": 2048, "I": 1024, "E": 16, "k": 4}
DECODE = {"T": 64, "H": 2048, "I": 1024, "E": 64, "k": 8}


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
    """The textbook loop with the layer's math: per expert gather, gate / up / down matmuls,
    SwiGLU in fp32 (rounded once to bf16), weighted fp32 index_add."""
    x, ids, w = p["x"], p["ids"], p["w"]
    inter = p["w2"].shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(p["w13"].shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        gate = xe @ p["w13"][e, :inter].t()
        up = xe @ p["w13"][e, inter:].t()
        y = (F.silu(gate.float()) * up.float()).bfloat16() @ p["w2"][e].t()
        out.index_add_(0, tok, y.float() * w[tok, slot].unsqueeze(1))
    return out.bfloat16()


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


def make_layer(p: dict[str, torch.Tensor], shape: dict[str, int]) -> MoEEpLayer:
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    fleet = FleetParams(shape["E"], shape["T"], shape["H"])
    return MoEEpLayer(boot, fleet, MoEWeightPack(p["w13"], p["w2"]), "any_bf16_bf16_bf16_torch")


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


def time_shape(shape: dict[str, int], reps: int) -> dict[str, float | bool]:
    """Round-robin minimum times (s) of the layer and the baselines on one shape."""
    p = problem(shape)
    layer = make_layer(p, shape)
    tensors = MoEEpTensors(p["x"], p["ids"], p["w"])
    pairs = shape["T"] * shape["k"]
    h, i = shape["H"], shape["I"]
    xd = torch.randn(pairs, h).bfloat16()
    hd = torch.randn(pairs, i).bfloat16()
    w13d = p["w13"][0].t()  # the same K-major weight layout the layer uses
    w2d = p["w2"][0].t()
    gu_d = torch.empty(pairs, 2 * i, dtype=torch.bfloat16)
    y_d = torch.empty(pairs, h, dtype=torch.bfloat16)
    t_layer, t_eager, t_dense, t_naive, t_naive16 = best_of(
        [
            lambda: layer(tensors),
            lambda: eager_epilogues(lambda: layer(tensors)),
            lambda: (torch.mm(xd, w13d, out=gu_d), torch.mm(hd, w2d, out=y_d)),
            lambda: naive_forward(p),
            lambda: naive_bf16_forward(p),
        ],
        reps,
    )
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
    wrap(experts, "_swiglu", "SwiGLU")
    wrap(kernel, "run_experts", "experts total")
    wrap(comm, "combine", "combine")
    try:
        yield
    finally:
        for mod, name, fn in reversed(patched):
            setattr(mod, name, fn)


def stages(reps: int) -> dict[str, float]:
    """Minimum thread CPU seconds per stage of a prefill forward at 1 thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    p = problem(PREFILL)
    layer = make_layer(p, PREFILL)
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
    xd = torch.randn(PREFILL["T"] * PREFILL["k"], PREFILL["H"]).bfloat16()
    hd = torch.randn(PREFILL["T"] * PREFILL["k"], PREFILL["I"]).bfloat16()
    gu = torch.empty(xd.shape[0], 2 * PREFILL["I"], dtype=torch.bfloat16)
    y = torch.empty_like(xd)
    torch.set_num_threads(1)
    try:
        for _ in range(reps):
            start = time.thread_time()
            torch.mm(xd, p["w13"][0].t(), out=gu)
            torch.mm(hd, p["w2"][0].t(), out=y)
            best["dense"] = min(best.get("dense", float("inf")), time.thread_time() - start)
    finally:
        torch.set_num_threads(threads)
    return best


def print_stages(console: Console, best: dict[str, float]) -> None:
    gemm, swiglu = best["expert GEMMs"], best["SwiGLU"]
    gathers = best["experts total"] - gemm - swiglu
    rest = best["forward"] - best["experts total"] - best["combine"]
    table = Table(title="prefill forward by stage, 1 thread, thread CPU time (min over reps)")
    for col in ("stage", "ms", "share of forward", "x dense GEMMs"):
        table.add_column(col, justify="right")
    for name, v in (
        ("expert GEMMs (FC1 + FC2)", gemm),
        ("SwiGLU (widen, silu, multiply, round)", swiglu),
        ("expert gathers + loop", gathers),
        ("combine (gather, widen, weight, slot sum)", best["combine"]),
        ("plan, dispatch, bookkeeping", rest),
        ("forward", best["forward"]),
        ("dense GEMMs (same useful FLOPs)", best["dense"]),
    ):
        table.add_row(
            name, f"{v * 1e3:.1f}", f"{v / best['forward']:.0%}", f"{v / best['dense']:.2f}"
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--plot", action="store_true", help="write benchmarks/out/layer_speed.png")
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=[1, 2],
        help="intra-op thread counts to measure, each in the same run (default: 1 2)",
    )
    parser.add_argument(
        "--stages", action="store_true", help="also print a per-stage breakdown at 1 thread"
    )
    args = parser.parse_args()
    console = Console(width=160)
    rows = []
    shapes = (("prefill", PREFILL), ("decode", DECODE))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("layer_speed", total=len(args.threads) * len(shapes) + 1)
        torch.set_num_threads(args.threads[0])
        progress.update(task, description=f"memory, {args.threads[0]} thread(s)")
        mem = memory(PREFILL)
        progress.advance(task)
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, shape in shapes:
                progress.update(task, description=f"{name}, {threads} thread(s), round-robin")
                rows.append((name, shape, threads, time_shape(shape, args.reps)))
                progress.advance(task)
    table = Table(
        title="portable bf16 layer, EP1, CPU (min over round-robin reps); "
        + "; ".join(
            f"{n}: T={sh['T']} H={sh['H']} I={sh['I']} E={sh['E']} k={sh['k']}" for n, sh in shapes
        )
    )
    for col in (
        "shape",
        "threads",
        "layer",
        "dense GEMMs",
        "naive loop",
        "layer/dense",
        "eager-epilogue layer/layer",
        "naive/layer",
        "naive-bf16/layer",
        "layer TFLOP/s",
    ):
        table.add_column(col, justify="right")
    for name, sh, threads, r in rows:
        flops = 6 * sh["T"] * sh["k"] * sh["H"] * sh["I"]
        target = " (target <= 1.3)" if name == "prefill" else ""
        table.add_row(
            name,
            str(threads),
            f"{r['layer'] * 1e3:.1f} ms",
            f"{r['dense'] * 1e3:.1f} ms",
            f"{r['naive'] * 1e3:.1f} ms",
            f"{r['layer'] / r['dense']:.2f}x{target}",
            f"{r['eager'] / r['layer']:.2f}x",
            f"{r['naive'] / r['layer']:.2f}x (target > 1)",
            f"{r['naive16'] / r['layer']:.2f}x",
            f"{flops / r['layer'] / 1e12:.2f}",
        )
    console.print(table)
    first, warm, ref = mem
    console.print(
        f"RSS added by a prefill forward ({args.threads[0]} thread(s)): first forward of a "
        f"fresh layer (allocates the reusable workspace) {first / 2**20:.0f} MiB = "
        f"{first / ref:.2f}x, warm forward {warm / 2**20:.0f} MiB = {warm / ref:.2f}x of inputs "
        f"+ outputs + one copy of the dispatched activations ({ref / 2**20:.0f} MiB); target "
        f"< 2x (RSS sampled every 0.2 ms, so approximate)"
    )
    console.print(f"bit-identical across two forwards: {all(r[3]['same'] for r in rows)}")
    if args.stages:
        print_stages(console, stages(args.reps))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = Path(__file__).parent / "out"
        out.mkdir(exist_ok=True)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        labels = [f"{r[0]}, {r[2]}t" for r in rows]
        series = (("layer", "layer"), ("dense GEMMs", "dense"), ("naive loop", "naive"))
        for j, (label, key) in enumerate(series):
            ax.bar(
                [x + 0.27 * j for x in range(len(rows))],
                [float(r[3][key]) * 1e3 for r in rows],
                width=0.27,
                label=label,
            )
        ax.set_xticks([x + 0.27 for x in range(len(rows))], labels)
        ax.set_ylabel("ms per forward (min)")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "layer_speed.png", dpi=120)
        console.print(f"wrote {out / 'layer_speed.png'}")


if __name__ == "__main__":
    main()

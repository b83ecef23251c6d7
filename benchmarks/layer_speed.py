"""Speed and memory of the portable bf16 layer at EP1 on CPU, as ratios from one run.

    uv run python benchmarks/layer_speed.py [--reps 3] [--plot]

Compares one `MoEEpLayer` forward (`any_bf16_bf16_bf16_torch`, world size 1) with
  - dense bf16 matmuls doing the same useful FLOPs (`[T*k, H] @ [H, 2I]` and
    `[T*k, I] @ [I, H]`): the machine's limit; target layer / dense <= 1.3;
  - a naive per-expert loop (gather, gate / up / down matmuls, index_add): target > 1x
    speed-up, on the prefill shape and on a decode-like shape;
and reports the peak resident memory added by a forward against inputs + outputs + one
copy of the dispatched activations (target < 2x). Times are the minimum over `--reps`
(the box is shared; the minimum is the least disturbed run).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
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
    """The textbook loop: per expert gather, gate / up / down matmuls, weighted index_add."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--plot", action="store_true", help="write benchmarks/out/layer_speed.png")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (1: on a shared box, spinning OpenMP threads distort timings)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = Console()
    rows = []
    mem: tuple[int, int] | None = None
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("layer_speed", total=8)
        for name, shape in (("prefill", PREFILL), ("decode", DECODE)):
            p = problem(shape)
            layer = make_layer(p, shape)
            tensors = MoEEpTensors(p["x"], p["ids"], p["w"])
            pairs = shape["T"] * shape["k"]
            xd = torch.randn(pairs, shape["H"]).bfloat16()
            hd = torch.randn(pairs, shape["I"]).bfloat16()
            w13d = p["w13"][0].t()  # the same K-major weight layout the layer uses
            w2d = p["w2"][0].t()
            progress.update(task, description=f"{name}: layer / dense / naive, round-robin")
            t_layer, t_dense, t_naive = best_of(
                [
                    lambda: layer(tensors),  # noqa: B023
                    lambda: (xd @ w13d, hd @ w2d),  # noqa: B023
                    lambda: naive_forward(p),  # noqa: B023
                ],
                args.reps,
            )
            progress.advance(task, 3)
            if name == "prefill":
                gc_free = peak_rss_during(lambda: layer(tensors))  # noqa: B023
                t, h, k = shape["T"], shape["H"], shape["k"]
                reference = 2 * t * h + 2 * t * h + 2 * t * k * h + 12 * t * k
                mem = (gc_free, reference)
            same = torch.equal(layer(tensors), layer(tensors))
            layer.destroy()
            flops = 6 * pairs * shape["H"] * shape["I"]
            rows.append((name, shape, t_layer, t_dense, t_naive, flops, same))
            progress.advance(task)
    table = Table(title=f"portable bf16 layer, EP1, CPU, {torch.get_num_threads()} threads")
    for col in (
        "shape",
        "layer",
        "dense GEMMs",
        "naive loop",
        "layer/dense",
        "naive/layer",
        "layer TFLOP/s",
    ):
        table.add_column(col, justify="right")
    for name, s, tl, td, tn, flops, _ in rows:
        table.add_row(
            f"{name} T={s['T']} H={s['H']} I={s['I']} E={s['E']} k={s['k']}",
            f"{tl * 1e3:.1f} ms",
            f"{td * 1e3:.1f} ms",
            f"{tn * 1e3:.1f} ms",
            f"{tl / td:.2f}x (target <= 1.3)",
            f"{tn / tl:.2f}x (target > 1)",
            f"{flops / tl / 1e12:.2f}",
        )
    console.print(table)
    if mem is not None:
        peak, ref = mem
        console.print(
            f"peak RSS added by a prefill forward: {peak / 2**20:.0f} MiB; inputs + outputs + "
            f"one copy of dispatched activations: {ref / 2**20:.0f} MiB; ratio "
            f"{peak / ref:.2f}x (target < 2x; RSS sampled every 0.2 ms, so approximate)"
        )
    console.print(f"bit-identical across two forwards: {all(r[6] for r in rows)}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = Path(__file__).parent / "out"
        out.mkdir(exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = [r[0] for r in rows]
        for j, (label, idx) in enumerate((("layer", 2), ("dense GEMMs", 3), ("naive loop", 4))):
            ax.bar(
                [x + 0.27 * j for x in range(len(rows))],
                [r[idx] * 1e3 for r in rows],
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

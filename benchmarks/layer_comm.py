"""EP2 gloo: byte rate of the portable dispatch + combine against a bare all_to_all_single.

    uv run python benchmarks/layer_comm.py [--tokens 2048] [--hidden 2048] [--experts 16]
        [--topk 4] [--reps 5] [--out benchmarks/out/layer_comm.png | --no-plot]

On 2 local ranks (gloo, CPU) it measures the portable backend's communication for one bf16
forward: dispatch (counts exchange, payload rows, pair metadata: `comm.exchange`) plus the
return trip (`comm.return_rows`), and the same plus the local fp32 top-k sum
(`comm.combine`); then one bare `all_to_all_single` moving the same number of bytes per
rank. Minimum over --reps of each, the slower rank's. Target (docs/runbook.md): dispatch +
return moves bytes at >= 80% of the bare rate; the row with the top-k sum, which adds local
compute and moves no bytes, is reported (n/a). Prints bytes per rank, times, GB/s and the
rate against the bare one with a status column, and plots the rates against the target.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from benchlib import OUT_DIR
from benchlib.options import (
    add_plot_options,
    benchmark_parser,
    positive_int,
    positive_multiple_of,
)

from moe_ep.bench import plots
from moe_ep.bench.limits import bare_all_to_all
from moe_ep.bench.machine import this_machine
from moe_ep.bench.progress import Steps
from moe_ep.bench.tables import console, titled_table
from moe_ep.bench.targets import Target, status
from moe_ep.spawn import spawn_local

WORLD_SIZE = 2
RATE = Target(">=", 0.80, unit="%", applies_to="dispatch + return")
STEPS = 5  # 1 in this process (spawn), 4 on rank 0


def _min_time(fn: Any, reps: int, barrier: Any) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        barrier()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def worker(rank: int, world_size: int, args: dict[str, int]) -> dict[str, float]:
    from moe_ep import BootstrapConfig
    from moe_ep.backends.portable import comm
    from moe_ep.backends.portable.recipes import Bf16Recipe
    from moe_ep.runtime import acquire

    torch.set_num_threads(1)
    reps = args["reps"]
    # Rank 0 tells the progress in plain lines (its stderr is the parent's).
    steps = Steps(STEPS, live=False, done=1)
    say = steps.step if rank == 0 else (lambda what: None)
    say("rendezvous, routing plan, first exchange")
    rt = acquire(BootstrapConfig(world_size, rank, timeout_s=120))
    try:
        t, h, e, k = args["tokens"], args["hidden"], args["experts"], args["topk"]
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(t, h, generator=g).bfloat16()
        ids = torch.rand(t, e, generator=g).topk(k, dim=1).indices
        w = torch.rand(t, k, generator=g)
        out = torch.empty(t, h, dtype=torch.bfloat16)
        recipe = Bf16Recipe()
        plan = comm.plan_dispatch(ids, e // world_size, world_size, True)
        payload = recipe.pack(x.index_select(0, plan.row_token))
        kw: dict[str, Any] = {"group": rt.group, "rank": rank}
        kw["workspace"] = comm.Workspace()  # as the kernel does: buffers reused

        recv = comm.exchange(plan, payload, world_size=world_size, **kw)
        # Stand-in for the experts' output rows (received pair order), made once: the
        # benchmark times communication, not the gather the experts would do.
        y = recipe.unpack(recv.rows, h).index_select(0, recv.pair_row)

        def comm_only() -> None:
            got = comm.exchange(plan, payload, world_size=world_size, **kw)
            comm.return_rows(y, got, plan, **kw)

        def with_sum() -> None:
            got = comm.exchange(plan, payload, world_size=world_size, **kw)
            back = comm.return_rows(y, got, plan, **kw)
            comm.combine(back, plan, w, out, workspace=kw["workspace"])

        sent = payload.numel() + plan.pair_meta.numel() * 4 + 16 * world_size
        sent += int(recv.pair_row.numel()) * h * 2  # the return trip
        say(f"dispatch + return, {reps} reps")
        t_comm = _min_time(comm_only, reps, rt.barrier)
        say(f"dispatch + combine with the fp32 top-k sum, {reps} reps")
        t_sum = _min_time(with_sum, reps, rt.barrier)
        most = torch.tensor([sent], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=rt.group)  # same size on every rank
        sent = int(most)
        say(f"bare all_to_all_single of {sent / 2**20:.1f} MiB, {reps} reps")
        t_bare = _min_time(bare_all_to_all(rt.group, sent, world_size), reps, rt.barrier)
        return {"bytes": float(sent), "comm": t_comm, "sum": t_sum, "bare": t_bare}
    finally:
        rt.release()


def build_parser() -> argparse.ArgumentParser:
    """The command line: every option with its help; the docstring as description."""
    parser = benchmark_parser(__doc__ or "")
    parser.add_argument("--tokens", type=positive_int, default=2048, help="tokens per rank")
    parser.add_argument("--hidden", type=positive_int, default=2048, help="hidden size H")
    parser.add_argument(
        "--experts",
        type=positive_multiple_of(WORLD_SIZE),
        default=16,
        help=f"experts E in all (a multiple of the {WORLD_SIZE} ranks)",
    )
    parser.add_argument("--topk", type=positive_int, default=4, help="experts per token k (<= E)")
    parser.add_argument(
        "--reps", type=positive_int, default=5, help="timed runs of each; the minimum counts"
    )
    add_plot_options(parser, OUT_DIR / "layer_comm.png")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.topk > ns.experts:
        parser.error(f"--topk must be <= --experts ({ns.experts}), got {ns.topk}")
    args = {key: getattr(ns, key) for key in ("tokens", "hidden", "experts", "topk", "reps")}
    with Steps(STEPS, live=False) as steps:
        steps.step(f"spawning {WORLD_SIZE} ranks (gloo)")
        res = spawn_local(worker, WORLD_SIZE, args, timeout_s=600)
    nbytes = max(r["bytes"] for r in res)
    t_comm, t_sum, t_bare = (max(r[key] for r in res) for key in ("comm", "sum", "bare"))

    machine = this_machine(threads=[1]).describe()
    shape = (
        f"EP{WORLD_SIZE} gloo, {ns.tokens} tokens/rank, H={ns.hidden}, E={ns.experts}, "
        f"k={ns.topk}, bf16, dedup; {nbytes / 2**20:.1f} MiB sent / rank; min of {ns.reps}"
    )
    table = titled_table(
        "moe-ep communication vs a bare all_to_all_single of the same bytes",
        shape,
        machine,
        ("what", "bytes sent / rank", "time", "GB/s", "rate vs bare", "target", "status"),
    )
    rows = (  # the target is on the bytes moved; the top-k sum moves none (reported)
        ("dispatch + return (moe-ep comm)", t_comm, RATE),
        ("dispatch + combine incl. fp32 top-k sum", t_sum, None),
    )
    table.add_row(
        "bare all_to_all_single",
        f"{nbytes / 2**20:.1f} MiB",
        f"{t_bare * 1e3:.1f} ms",
        f"{nbytes / t_bare / 1e9:.2f}",
        "100%",
        "(reference)",
        status(1.0, None),
    )
    for name, sec, target in rows:
        rate = t_bare / sec
        table.add_row(
            name,
            f"{nbytes / 2**20:.1f} MiB",
            f"{sec * 1e3:.1f} ms",
            f"{nbytes / sec / 1e9:.2f}",
            f"{rate:.0%}",
            target.label() if target else "(reported)",
            status(rate, target),
        )
    out = console()
    out.print(table)
    if not ns.no_plot:
        fig, (ax,) = plots.figure(1, 1, width=9, height=4.8)
        plots.title(
            fig, "byte rate / bare all_to_all_single rate (higher is better)", shape, machine
        )
        bars = (("bare all_to_all_single (reference)", t_bare, None), *rows)
        names = [f"{name}\n{nbytes / sec / 1e9:.2f} GB/s" for name, sec, _ in bars]
        rates = [t_bare / sec for _, sec, _ in bars]
        shown = plots.ratio_bars(ax, names, rates, [t for *_, t in bars], unit="%", wrap=22)
        ax.set_ylabel("rate vs bare all_to_all_single")
        plots.status_legend(fig, shown)
        out.print(f"wrote {plots.save(fig, ns.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

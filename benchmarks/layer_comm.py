"""EP2 gloo: bytes rate of the portable dispatch + combine vs a bare all_to_all_single.

    uv run python benchmarks/layer_comm.py [--tokens 2048] [--hidden 2048] [--reps 5]

On 2 local ranks (gloo, CPU) it times the portable backend's communication for one bf16
forward: dispatch (counts exchange, payload rows, pair metadata: `comm.exchange`) plus the
return trip (`comm.return_rows`), and the same plus the local fp32 top-k sum
(`comm.combine`). It then times one bare `all_to_all_single` moving the same number of
bytes per rank. Printed: bytes per rank, times, GB/s, and the ratio of rates (target: the
dispatch + combine communication, i.e. dispatch + return, moves bytes at >= 80% of the bare
rate; the row with the top-k sum, which adds local compute and moves no bytes, is reported).
Minimum over `--reps`.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from moe_ep.launch import spawn_local


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
        kw = {"group": rt.group, "rank": rank, "world_size": world_size}
        kw["workspace"] = comm.Workspace()  # as the kernel does: buffers reused

        recv = comm.exchange(plan, payload, **kw)
        # Stand-in for the experts' output rows (received pair order), made once: the
        # benchmark times communication, not the gather the experts would do.
        y = recipe.unpack(recv.rows, h).index_select(0, recv.pair_row)

        def comm_only() -> None:
            got = comm.exchange(plan, payload, **kw)
            comm.return_rows(y, got, plan, **kw)

        def with_sum() -> None:
            got = comm.exchange(plan, payload, **kw)
            back = comm.return_rows(y, got, plan, **kw)
            comm.combine(back, plan, w, out, workspace=kw["workspace"])

        sent = payload.numel() + plan.pair_meta.numel() * 4 + 16 * world_size
        sent += int(recv.pair_row.numel()) * h * 2  # the return trip
        reps = args["reps"]
        t_comm = _min_time(comm_only, reps, rt.barrier)
        t_sum = _min_time(with_sum, reps, rt.barrier)
        most = torch.tensor([sent], dtype=torch.int64)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=rt.group)  # same size on every rank
        sent = int(most)
        chunk = -(-sent // world_size)
        src = torch.zeros(chunk * world_size, dtype=torch.uint8)
        dst = torch.empty_like(src)
        t_bare = _min_time(
            lambda: dist.all_to_all_single(dst, src, group=rt.group), reps, rt.barrier
        )
        return {"bytes": float(sent), "comm": t_comm, "sum": t_sum, "bare": t_bare}
    finally:
        rt.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    args = vars(parser.parse_args())
    console = Console()
    with console.status("running 2 ranks (gloo)..."):
        res = spawn_local(worker, 2, args, timeout_s=600)
    nbytes = max(r["bytes"] for r in res)
    t_comm = max(r["comm"] for r in res)
    t_sum = max(r["sum"] for r in res)
    t_bare = max(r["bare"] for r in res)
    table = Table(
        title=(
            f"EP2 gloo, {args['tokens']} tokens/rank, H={args['hidden']}, E={args['experts']}, "
            f"k={args['topk']}, bf16, dedup"
        )
    )
    for col in ("what", "bytes sent / rank", "time", "GB/s", "rate vs bare"):
        table.add_column(col, justify="right")
    rows = (  # the target is on the bytes moved; the top-k sum moves none (reported)
        ("bare all_to_all_single", t_bare, ""),
        ("dispatch + return (moe-ep comm)", t_comm, " (target >= 80%)"),
        ("dispatch + combine incl. fp32 top-k sum", t_sum, " (reported: adds local compute)"),
    )
    for name, sec, note in rows:
        table.add_row(
            name,
            f"{nbytes / 2**20:.1f} MiB",
            f"{sec * 1e3:.1f} ms",
            f"{nbytes / sec / 1e9:.2f}",
            f"{t_bare / sec:.0%}{note}",
        )
    console.print(table)


if __name__ == "__main__":
    main()

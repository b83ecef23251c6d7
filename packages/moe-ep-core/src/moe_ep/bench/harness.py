"""The measurement of `moe-ep bench`: every (shape, routing, kernel) at one world size, on
local ranks, with the limits of each shape measured in the same run.

Each rank builds its shard of the synthetic problem of `moe-ep run` (`moe_ep.cli.problem`:
per-rank tokens, per-expert weights, uniform or skewed routing), and from the routing of all
ranks (cheap: seeded per rank) the pairs it receives, its active experts and the bytes it
sends. Per (shape, routing) it times, round-robin after warm-up:
  - dense GEMMs of the useful FLOPs of the pairs it receives (bf16 and fp32; the faster);
  - at world size > 1, a bare `all_to_all_single` of the bytes the busiest rank moves
    (dispatch of each token once per destination rank + the return of each pair, bf16);
  - at world size 1, the naive per-expert loop and transformers' experts (optional);
then each kernel's forward. A barrier starts every timed run on all ranks together; a
forward's time is the slowest rank's in that run (the caller merges), its limits the
slowest rank's. The bandwidth limit is the active experts' weight bytes in the kernel's
stored format over the read bandwidth each rank measures (all ranks reading at once), before
the timings and after them: the faster of the two (a stricter limit, so that a neighbour's
load at one read never meets a target).
"""

from __future__ import annotations

import functools
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moe_ep.bench.shapes import BenchShape

ACT_BYTES = {"bf16": 2.0, "fp8": 1.0 + 4 / 128, "mxfp8": 1.0 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
"""Bytes per activation element sent by dispatch, per act format tag (codes + scales)."""
WEIGHT_BYTES = {
    "bf16": 2.0,
    "fp8": 1.0 + 4 / (128 * 128),
    "mxfp8": 1.0 + 1 / 32,
    "nvfp4": 0.5 + 1 / 16,
    "fp4": 0.5 + 1 / 32,
    "mxfp4": 0.5 + 1 / 32,
}
"""Stored bytes per weight element, per weight format tag (codes + block scales)."""
BANDWIDTH_BYTES = 256 << 20
"""Bytes of each read-bandwidth measurement: far past a last-level cache, small enough for
four ranks on a small machine."""


@dataclass(frozen=True)
class BenchJob:
    """What one world size runs (picklable: sent to every spawned rank)."""

    shapes: tuple[BenchShape, ...]
    kernels: tuple[str, ...]
    routings: tuple[str, ...]
    reps: int
    warmup: int
    peers: bool
    threads: int | None = None
    step_offset: int = 0
    step_total: int = 1


def steps_of(job: BenchJob) -> int:
    """Progress steps one world size announces (bandwidth, then per shape and routing the
    limits and each kernel, then bandwidth again)."""
    return 2 + len(job.shapes) * len(job.routings) * (1 + len(job.kernels))


@dataclass
class RankRow:
    """One rank's measurement of one (shape, routing, kernel)."""

    shape: BenchShape
    routing: str
    kernel: str
    runs: list[float] = field(default_factory=list)
    skipped: str = ""
    limits: dict[str, float] = field(default_factory=dict)
    limit_notes: dict[str, str] = field(default_factory=dict)


def problem_spec(shape: BenchShape, world_size: int, routing: str, kernel: str) -> Any:
    """The synthetic problem of `moe-ep run` (`moe_ep.cli.problem.JobSpec`) for `shape`,
    unchecked (the bench and the tuner time it; `run` checks it)."""
    from moe_ep.cli.problem import JobSpec

    return JobSpec(
        kernels=(kernel,),
        world_size=world_size,
        tokens=shape.tokens,
        hidden=shape.hidden,
        intermediate=shape.inter,
        experts=shape.experts,
        topk=shape.topk,
        routing=routing,
        check=False,
    )


@dataclass(frozen=True)
class Traffic:
    """What one rank does for one routing: pairs received, active local experts, bytes it
    sends (per act format: the dispatched token rows' elements; the returned pairs' rows)."""

    pairs: int
    active: int
    token_rows_sent: int
    pair_rows_returned: int


def traffic(all_ids: list[Any], rank: int, local_experts: int) -> Traffic:
    """`Traffic` of `rank` from every rank's `topk_ids` (global expert ids)."""
    import torch

    owner = [ids // local_experts for ids in all_ids]
    received = torch.cat([ids[o == rank] for ids, o in zip(all_ids, owner, strict=True)])
    mine = owner[rank]
    dests = sum(int((mine == d).any(dim=1).sum()) for d in range(len(all_ids)))
    return Traffic(
        pairs=int(received.numel()),
        active=int(received.unique().numel()),
        token_rows_sent=dests,
        pair_rows_returned=int(received.numel()),
    )


def _median(samples: Any) -> float:
    return float(statistics.median(samples.runs))


def _limit_fns(
    shape: BenchShape, world_size: int, mine: dict[str, Any], tr: Traffic, peers: bool,
    w13: Any, w2: Any, device: Any,
) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:  # fmt: skip
    """The limits timed once per (shape, routing): dense GEMMs; at EP1 the naive loop and
    transformers' experts; `notes` say why one is absent."""
    import torch

    from moe_ep.bench import hf_peer
    from moe_ep.bench.limits import dense_gemms, naive_forward

    fns: dict[str, Callable[[], object]] = {}
    notes: dict[str, str] = {}
    pairs = max(tr.pairs, 1)
    fns["dense bf16"] = dense_gemms(pairs, shape.hidden, shape.inter, torch.bfloat16, device)
    fns["dense fp32"] = dense_gemms(pairs, shape.hidden, shape.inter, torch.float32, device)
    if world_size == 1:
        notes["all_to_all"] = "world size 1: no communication"
    if world_size != 1:
        notes["naive"] = notes["peer"] = "single-process baselines: EP1 only"
        return fns, notes
    x, ids, w = mine["x"], mine["ids"], mine["topk_weights"]
    fns["naive"] = lambda: naive_forward(x, ids, w, w13, w2)
    why = hf_peer.unavailable() if peers else "not requested (--no-peers)"
    if why is not None:
        notes["peer"] = why
        return fns, notes
    for impl in hf_peer.IMPLEMENTATIONS:
        per_pair = 3 * shape.hidden * shape.inter * 2
        if impl == "batched_mm" and tr.pairs * per_pair > hf_peer.BATCHED_MM_MAX_BYTES:
            continue  # gathers a weight copy per pair: too large
        fwd = hf_peer.experts_forward(w13, w2, shape.topk, impl)
        fns[f"hf {impl}"] = functools.partial(fwd, x, ids, w)
    return fns, notes


def _a2a_limits(
    job: BenchJob, world_size: int, group: Any, act_bytes: dict[str, int], barrier: Any
) -> dict[str, float]:
    """Median seconds of a bare all_to_all of each act format's bytes the kernels need."""
    from moe_ep.bench.limits import bare_all_to_all
    from moe_ep.bench.timing import round_robin
    from moe_ep.registry import parse_kernel_name

    if world_size == 1:
        return {}
    acts = dict.fromkeys(parse_kernel_name(k).act for k in job.kernels)
    fns = {a: bare_all_to_all(group, act_bytes.get(a, act_bytes["bf16"]), world_size) for a in acts}
    got = round_robin(fns, job.reps, warmup=job.warmup, barrier=barrier)
    return {a: _median(v) for a, v in got.items()}


@dataclass
class _Rank:
    """What one rank's measurements share: its runtime, bootstrap, device, job."""

    rank: int
    world_size: int
    job: BenchJob
    runtime: Any
    boot: Any
    bandwidth: float
    say: Callable[[str], None]

    @property
    def barrier(self) -> Callable[[], object] | None:
        return self.runtime.barrier if self.world_size > 1 else None


def _time_kernel(ctx: _Rank, row: RankRow, mine: dict[str, Any], w13: Any, w2: Any) -> None:
    """`row.runs`: the kernel's forward timed round-robin (skipped with the reason when the
    kernel is unavailable here)."""
    from moe_ep import FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep.bench.timing import round_robin
    from moe_ep.contract import MegaKernel
    from moe_ep.errors import MoeEpUsageError
    from moe_ep.registry import get_kernel

    kernel_cls: type[MegaKernel] = get_kernel(row.kernel)
    ok, reason = kernel_cls.availability()
    if not ok:
        row.skipped = reason
        return
    shape = row.shape
    fleet = FleetParams(shape.experts, shape.tokens, shape.hidden)
    pack = MoEWeightPack(w13, w2)
    try:  # local, the same on every rank: a shape the kernel refuses is a skipped row
        kernel_cls.validate_weights(pack, fleet, ctx.world_size, kernel_cls.config_cls())
    except MoeEpUsageError as exc:
        row.skipped = str(exc)
        return
    layer = MoEEpLayer(ctx.boot, fleet, pack, row.kernel)
    try:
        tensors = MoEEpTensors(mine["x"], mine["ids"], mine["topk_weights"])
        forward: Callable[[], object] = lambda: layer(tensors)  # noqa: E731
        timed = round_robin(
            {"layer": forward},
            ctx.job.reps,
            warmup=ctx.job.warmup,
            barrier=ctx.barrier,
            device=ctx.runtime.device,
        )
        row.runs = timed["layer"].runs
    finally:
        layer.destroy()


def _shape_routing(ctx: _Rank, shape: BenchShape, routing: str) -> list[RankRow]:
    """This rank's rows of one (shape, routing): its limits, then each kernel."""
    from moe_ep.bench.timing import round_robin
    from moe_ep.cli.problem import expert_weights, rank_tokens
    from moe_ep.registry import parse_kernel_name

    job, ws, dev = ctx.job, ctx.world_size, ctx.runtime.device
    el = shape.experts // ws
    spec = problem_spec(shape, ws, routing, job.kernels[0])
    all_tokens = [rank_tokens(spec, r) for r in range(ws)]
    mine = {k: v.to(dev) for k, v in all_tokens[ctx.rank].items()}
    per_rank = [traffic([t["ids"] for t in all_tokens], r, el) for r in range(ws)]
    tr = per_rank[ctx.rank]
    w13, w2 = expert_weights(spec, list(range(ctx.rank * el, (ctx.rank + 1) * el)))
    w13, w2 = w13.to(dev), w2.to(dev)
    what = f"EP{ws} {shape.family} {shape.text()} {routing}"
    ctx.say(f"{what}: limits (dense, all_to_all, naive, peers) x{job.reps}")
    returned = max(t.pair_rows_returned for t in per_rank) * shape.hidden * 2
    sent = max(t.token_rows_sent for t in per_rank) * shape.hidden
    act_bytes = {a: int(sent * b) + returned for a, b in ACT_BYTES.items()}
    fns, notes = _limit_fns(shape, ws, mine, tr, job.peers, w13, w2, dev)
    got = round_robin(fns, job.reps, warmup=job.warmup, barrier=ctx.barrier, device=dev)
    limits = {k: _median(v) for k, v in got.items()}
    a2a = _a2a_limits(job, ws, ctx.runtime.group, act_bytes, ctx.barrier)
    rows = []
    for kernel in job.kernels:
        ctx.say(f"{what}: {kernel} x{job.reps}")
        tags = parse_kernel_name(kernel)
        row = RankRow(shape, routing, kernel, limits=dict(limits), limit_notes=notes)
        weight_bytes = tr.active * 3 * shape.hidden * shape.inter * WEIGHT_BYTES[tags.weight]
        row.limits["bandwidth"] = weight_bytes / ctx.bandwidth
        if tags.act in a2a:
            row.limits["all_to_all"] = a2a[tags.act]
        _time_kernel(ctx, row, mine, w13, w2)
        rows.append(row)
    return rows


def bench_rank(rank: int, world_size: int, job: BenchJob) -> dict[str, Any]:
    """One rank's measurements (top level so it can be spawned): every (shape, routing,
    kernel) of `job`, in order. Returns `{"bandwidth": B/s, "rows": [RankRow, ...]}`."""
    import torch

    from moe_ep import BootstrapConfig
    from moe_ep.bench.limits import read_bandwidth
    from moe_ep.bench.progress import Steps
    from moe_ep.runtime import acquire
    from moe_ep.spawn import free_port

    if job.threads is not None:
        torch.set_num_threads(job.threads)
    elif not torch.cuda.is_available():  # ranks share the cores: one thread share each
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    # spawned ranks: plain lines on the parent's stderr; in-process: a bar on a terminal
    steps = Steps(job.step_total, live=None if world_size == 1 else False, done=job.step_offset)
    say = steps.step if rank == 0 else (lambda what: None)
    init = f"tcp://127.0.0.1:{free_port()}" if world_size == 1 else None
    boot = BootstrapConfig(world_size, rank, init_method=init)
    rt = acquire(boot)
    rows: list[RankRow] = []
    try:
        with steps:
            say(f"EP{world_size}: read bandwidth, {torch.get_num_threads()} thread(s) per rank")
            rt.barrier()
            bw = statistics.median(read_bandwidth(3, BANDWIDTH_BYTES))
            ctx = _Rank(rank, world_size, job, rt, boot, bw, say)
            for shape in job.shapes:
                for routing in job.routings:
                    rows += _shape_routing(ctx, shape, routing)
            say(f"EP{world_size}: read bandwidth again")
            rt.barrier()
            bw = stricter_limits(rows, bw, statistics.median(read_bandwidth(3, BANDWIDTH_BYTES)))
    finally:
        rt.release()
    return {"bandwidth": bw, "rows": rows}


def stricter_limits(rows: list[RankRow], before: float, after: float) -> float:
    """The faster of the two bandwidth reads (bytes / s); `rows`' bandwidth limits, computed
    at `before`, rescaled to it in place."""
    best = max(before, after)
    for row in rows:
        if "bandwidth" in row.limits:
            row.limits["bandwidth"] *= before / best
    return best

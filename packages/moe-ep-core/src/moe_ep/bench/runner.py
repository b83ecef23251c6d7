"""Run the bench: validate the request, then each world size on its own local ranks."""

from __future__ import annotations

from dataclasses import dataclass, replace

from moe_ep.bench.harness import BenchJob, RankRow, bench_rank, steps_of
from moe_ep.bench.results import BenchRow, merge
from moe_ep.bench.shapes import BenchShape
from moe_ep.bench.targets import layer_targets
from moe_ep.errors import MoeEpUsageError

ROUTINGS = ("uniform", "skewed")
WORLD_SIZES = (1, 2, 4)


@dataclass(frozen=True)
class BenchRequest:
    """What `moe-ep bench` was asked to run."""

    shapes: tuple[BenchShape, ...]
    world_sizes: tuple[int, ...]
    routings: tuple[str, ...]
    kernels: tuple[str, ...]
    reps: int = 5
    warmup: int = 1
    peers: bool = True
    timeout_s: float = 1800.0


def available_kernels() -> tuple[str, ...]:
    """Every kernel available on this machine, by name (portable first, as listed)."""
    from moe_ep.registry import available_kernels as listed

    return tuple(info.name for info in listed() if info.available)


def kernel_name(text: str) -> str:
    """The canonical name of `--kernel text` (a deprecated alias warns and resolves).

    Raises:
        MoeEpUsageError: an unknown name, naming it and the known ones.
    """
    from moe_ep.registry import available_kernels as listed
    from moe_ep.registry import resolve_kernel_name

    known = {info.name for info in listed()}
    try:
        name = resolve_kernel_name(text)
    except KeyError:
        name = text
    if name not in known:
        raise MoeEpUsageError(f"--kernel {text!r}: unknown kernel, known: {sorted(known)}")
    return name


def check_routing(routing: str) -> None:
    """`MoeEpUsageError` unless `routing` is one of `ROUTINGS`."""
    if routing not in ROUTINGS:
        raise MoeEpUsageError(f"--routing must be one of {ROUTINGS}, got {routing!r}")


def check_request(req: BenchRequest) -> None:
    """`MoeEpUsageError` naming the option, value and rule, before any rank starts."""
    if not req.shapes:
        raise MoeEpUsageError("--shape: no shape to run (give --shape T,H,I,E,k)")
    if not req.kernels:
        raise MoeEpUsageError("--kernel: no kernel available on this machine to run")
    for k in req.kernels:
        kernel_name(k)
    for ws in req.world_sizes:
        if ws < 1:
            raise MoeEpUsageError(f"--ep must be >= 1, got {ws}")
        for s in req.shapes:
            if s.experts % ws:
                raise MoeEpUsageError(
                    f"--ep {ws}: the experts of shape {s.text()} ({s.experts}) must be divisible "
                    "by every world size"
                )
    for r in req.routings:
        check_routing(r)
    if req.reps < 1:
        raise MoeEpUsageError(f"--reps must be >= 1, got {req.reps}")
    if req.warmup < 0:
        raise MoeEpUsageError(f"--warmup must be >= 0, got {req.warmup}")
    if not req.timeout_s > 0:
        raise MoeEpUsageError(f"--timeout must be > 0 seconds, got {req.timeout_s}")


def run_bench(req: BenchRequest) -> tuple[list[BenchRow], dict[int, float]]:
    """Every row of `req` and the read bandwidth (bytes / s, slowest rank) per world size.

    Raises:
        MoeEpUsageError: a bad request (before any rank starts).
        MoeEpPeerError / MoeEpTimeoutError: a rank failed or `timeout_s` passed (per world
            size).
    """
    from moe_ep import spawn
    from moe_ep.cli.exits import rank_failure_error
    from moe_ep.registry import parse_kernel_name

    check_request(req)
    job = BenchJob(req.shapes, req.kernels, req.routings, req.reps, req.warmup, req.peers)
    total = steps_of(job) * len(req.world_sizes)
    rows: list[BenchRow] = []
    bandwidth: dict[int, float] = {}
    for j, ws in enumerate(req.world_sizes):
        this = replace(job, step_offset=j * steps_of(job), step_total=total)
        if ws == 1:
            results = [bench_rank(0, 1, this)]
        else:
            run = spawn.launch_local(bench_rank, ws, this, timeout_s=req.timeout_s)
            if not run.ok:
                raise rank_failure_error(run) from run.error()
            results = run.values()
        per_rank: list[list[RankRow]] = [r["rows"] for r in results]
        bandwidth[ws] = min(r["bandwidth"] for r in results)
        for row in merge(ws, per_rank):
            s = row.shape
            dims = (s.tokens, s.hidden, s.inter, s.experts, s.topk)
            row.targets = layer_targets(dims, parse_kernel_name(row.kernel).weight, ws, row.routing)
            rows.append(row)
    return rows, bandwidth

"""`moe-ep tune`: sweep a kernel's knobs on one problem and cache the winner
(`moe_ep.tune`; layers built from the kernel's name read it at construction)."""

from __future__ import annotations

import argparse
from typing import Any

from moe_ep.cli.exits import EXIT_OK

DEFAULT_KERNEL = "any_bf16_bf16_bf16_torch"
DEFAULT_SHAPE = "64,2048,1024,64,8"
QUICK_SHAPE = "128,1024,512,16,4"


def add_parser(sub: Any) -> None:
    """Register `tune` on the `moe-ep` subcommands."""
    p = sub.add_parser(
        "tune",
        help="sweep a kernel's knobs on a problem and cache the winner (MOE_EP_TUNING_CACHE)",
        description="Time every candidate of the kernel's knob grid (median of --reps forwards "
        "after --warmup, per routing, inputs restaged) on --ep local ranks; each candidate's "
        "time is the slowest rank's, so every rank picks the same winner; the winner goes to "
        "the tuning cache keyed by kernel, arch, token bucket (the max over ranks), H, I, E, "
        "world size and versions. An interrupted sweep resumes where it stopped.",
    )
    p.add_argument(
        "--quick", action="store_true", help=f"the bf16 kernel on {QUICK_SHAPE} at EP2, 3 reps"
    )
    p.add_argument("--kernel", default=DEFAULT_KERNEL, help=f"the kernel ({DEFAULT_KERNEL})")
    p.add_argument(
        "--shape",
        default=None,
        metavar="T,H,I,E,k",
        help=f"tokens per rank, hidden, intermediate, experts, top-k (default {DEFAULT_SHAPE})",
    )
    p.add_argument("--ep", type=int, default=None, help="world size, local ranks (default 2)")
    p.add_argument(
        "--routing", nargs="+", default=["uniform", "skewed"], help="routings timed per candidate"
    )
    p.add_argument(
        "--reps", type=int, default=None, help="timed forwards per candidate and routing (5)"
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed forwards first (1)")
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds for the spawned ranks (1800)"
    )


def job_of(args: argparse.Namespace) -> Any:
    """The `TuneJob` of the options (usage errors name the option, value and rule)."""
    from moe_ep.bench.runner import check_routing, kernel_name
    from moe_ep.bench.shapes import parse_shape
    from moe_ep.errors import MoeEpUsageError
    from moe_ep.tune.tuners import TuneJob
    from moe_ep.tuning import cache_path

    shape = parse_shape(args.shape or (QUICK_SHAPE if args.quick else DEFAULT_SHAPE))
    if args.ep is None:
        args.ep = 2
    if args.reps is None:
        args.reps = 3 if args.quick else 5
    kernel = kernel_name(args.kernel)
    if args.ep < 1 or shape.experts % args.ep:
        raise MoeEpUsageError(
            f"--ep must be >= 1 and divide the experts ({shape.experts}), got {args.ep}"
        )
    for r in args.routing:
        check_routing(r)
    if args.reps < 1 or args.warmup < 0:
        raise MoeEpUsageError(
            f"--reps must be >= 1 and --warmup >= 0, got {args.reps} and {args.warmup}"
        )
    if not args.timeout > 0:
        raise MoeEpUsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    return TuneJob(
        kernel=kernel,
        tokens=shape.tokens,
        hidden=shape.hidden,
        inter=shape.inter,
        experts=shape.experts,
        topk=shape.topk,
        routings=tuple(dict.fromkeys(args.routing)),
        reps=args.reps,
        warmup=args.warmup,
        cache=str(cache_path(create=True)),
    )


def run(args: argparse.Namespace) -> int:
    """Tune, print the candidates' times and the winner, and where it was written."""
    from rich.table import Table

    from moe_ep import env, spawn
    from moe_ep.bench.tables import console
    from moe_ep.cli.exits import rank_failure_error
    from moe_ep.errors import MoeEpUnavailableError
    from moe_ep.registry import get_kernel
    from moe_ep.tune.tuners import tune_rank, valid_grid

    env.check_all()
    job = job_of(args)
    kernel_cls: Any = get_kernel(job.kernel)
    ok, reason = kernel_cls.availability()
    if not ok:
        raise MoeEpUnavailableError(f"kernel {job.kernel!r}: {reason}")
    valid_grid(kernel_cls, args.ep)  # a kernel without knobs is refused before any rank starts
    if args.ep == 1:
        winner = tune_rank(0, 1, job)
    else:
        run_ = spawn.launch_local(tune_rank, args.ep, job, timeout_s=args.timeout)
        if not run_.ok:
            raise rank_failure_error(run_) from run_.error()
        winner = run_.values()[0]
    table = Table(
        title=f"moe-ep tune {job.kernel}, T={job.tokens} H={job.hidden} I={job.inter} "
        f"E={job.experts} k={job.topk}, EP{args.ep}, routings {', '.join(job.routings)}",
        caption=f"median of {job.reps} forwards after {job.warmup} warm-up, summed over the "
        "routings; the slowest rank's",
    )
    for col in ("knobs", "time", "vs winner", ""):
        table.add_column(col, justify="left" if col == "knobs" else "right")
    for cid, t in winner.timings.items():
        mark = "winner" if cid == json_id(winner.knobs) else ""
        shown = "refused" if t == float("inf") else f"{t * 1e3:.2f} ms"
        table.add_row(cid, shown, f"{t / winner.seconds:.2f}x", mark)
    out = console()
    out.print(table)
    if winner.resumed:
        out.print(f"resumed: {winner.resumed} candidate(s) timed by an interrupted sweep")
    out.print(f"winner {json_id(winner.knobs)} written to {job.cache}")
    return EXIT_OK


def json_id(knobs: dict[str, Any]) -> str:
    from moe_ep.tune.sweep import candidate_id

    return candidate_id(knobs)

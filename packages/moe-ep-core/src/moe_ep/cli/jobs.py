"""`moe-ep demo` and `moe-ep run`: run the layer on a synthetic problem, check it, time it.

`demo` (no arguments) runs every portable format on 2 local ranks (gloo on CPU, NCCL on
CUDA, plus the best available GPU kernel there) on a small DeepSeek-like shape, checks each
against the oracle and prints one table. `run` does the same for one kernel and any shape;
under torchrun (RANK / WORLD_SIZE set) it runs in this process (env://) instead of spawning
local ranks.

Every rank builds only its shard of the problem (its tokens, its experts; `problem`) and
checks its own output rows against the oracle, which it builds from the weights of only the
experts its tokens route to, a chunk at a time; no rank gathers the others' outputs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import asdict
from typing import Any

from moe_ep.cli.exits import EXIT_CHECK_FAILED, EXIT_OK
from moe_ep.cli.problem import JobSpec
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError

__all__ = ["JobSpec", "add_parsers", "run_command", "run_job"]

DEFAULT_KERNEL = "any_bf16_bf16_bf16_torch"
DEMO_SHAPE: dict[str, Any] = {
    "tokens": 128,
    "hidden": 512,
    "intermediate": 256,
    "experts": 16,
    "topk": 4,
}


def portable_kernels() -> tuple[str, ...]:
    """The portable kernels (taxonomy arch `any`) the registry lists, by name."""
    from moe_ep.registry import available_kernels

    return tuple(
        info.name
        for info in available_kernels()
        if info.taxonomy is not None and info.taxonomy.arch == "any"
    )


def oracle_formats() -> dict[tuple[str, str], str]:
    """(act, weight) taxonomy tags -> the oracle format, from each portable kernel's
    `oracle_format` (a GPU kernel is checked against the portable kernel of its tags)."""
    from moe_ep.registry import get_kernel, parse_kernel_name

    out = {}
    for name in portable_kernels():
        fmt = getattr(get_kernel(name), "oracle_format", None)
        if isinstance(fmt, str):
            parsed = parse_kernel_name(name)
            out[(parsed.act, parsed.weight)] = fmt
    return out


def oracle_format(kernel: str) -> str:
    """The oracle format of a kernel name, from its taxonomy (act, weight) tags."""
    from moe_ep.registry import parse_kernel_name

    parsed = parse_kernel_name(kernel)
    fmt = oracle_formats().get((parsed.act, parsed.weight))
    if fmt is None:
        raise MoeEpUsageError(
            f"no oracle format for kernel {kernel!r} ({parsed.act} x {parsed.weight})"
        )
    return fmt


def run_job(
    rank: int, world_size: int, spec: JobSpec, gather: bool = False
) -> list[dict[str, Any]]:
    """One rank's work (top level so it can be spawned): every kernel of `spec`, in order.

    Returns this rank's rows, or with `gather` every rank's rows (all_gather_object over the
    EP group, used under torchrun) as a list per rank.
    """
    import torch

    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep.cli.problem import expert_weights, rank_oracle, rank_tokens
    from moe_ep.oracle import compare_to_oracle
    from moe_ep.runtime import acquire

    if not torch.cuda.is_available():
        # Ranks share the cores: oversubscribed OpenMP threads spin and crawl.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    el = spec.local_experts
    w13, w2 = expert_weights(spec, list(range(rank * el, (rank + 1) * el)))
    mine = rank_tokens(spec, rank)
    boot = BootstrapConfig(world_size, rank)
    keep = acquire(boot)
    rows: list[dict[str, Any]] = []
    try:
        for kernel in spec.kernels:
            layer = MoEEpLayer(
                boot,
                FleetParams(spec.experts, max(spec.tokens, 1), spec.hidden),
                MoEWeightPack(w13, w2),
                kernel,
            )
            dev = layer.device
            tensors = MoEEpTensors(
                mine["x"].to(dev), mine["ids"].to(dev), mine["topk_weights"].to(dev)
            )
            out = layer(tensors)  # warm-up
            keep.barrier()
            start = time.perf_counter()
            for _ in range(spec.iters):
                out = layer(tensors)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            per_forward = (time.perf_counter() - start) / spec.iters
            layer.destroy()
            row: dict[str, Any] = {"kernel": kernel, "seconds": per_forward, "rank": rank}
            if spec.check:
                report = compare_to_oracle(
                    out.cpu(), rank_oracle(spec, mine, oracle_format(kernel))
                )
                row.update(
                    ratio=report.max_ratio,
                    global_ratio=report.rel_err / report.rel_bound,
                    ok=report.ok,
                    detail=str(report),
                )
            rows.append(row)
        if gather:
            import torch.distributed as dist

            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, rows, group=keep.group)
            return everyone
        return rows
    finally:
        keep.release()


def _torchrun_rank_and_world_size() -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when launched by torchrun (both set), None when neither is set.

    Raises:
        MoeEpUsageError: a malformed or partial torchrun environment (RANK=x, RANK without
            WORLD_SIZE, RANK >= WORLD_SIZE, no MASTER_ADDR / MASTER_PORT).
    """
    from moe_ep import env

    launched = env.torchrun_rank_and_world_size()
    if launched is not None and env.master_addr_port() is None:
        raise MoeEpUsageError(
            "RANK and WORLD_SIZE are set (torchrun) but MASTER_ADDR and MASTER_PORT are not; "
            "launch with torchrun, or unset RANK and WORLD_SIZE to spawn local ranks"
        )
    return launched


def preflight(spec: JobSpec) -> None:
    """Checks that need no rank: every environment variable, the spec itself, enough GPUs
    for the spawned ranks, each kernel's shape rules; warns when the spawned ranks would
    overload this machine (`capacity`)."""
    from moe_ep import env
    from moe_ep.layer.layer import resolve_backend

    env.check_all()
    spec.validate()
    if _torchrun_rank_and_world_size() is None:  # spawned ranks bind cuda:0..N-1
        import torch

        from moe_ep.cli.capacity import capacity_warnings

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if 0 < count < spec.world_size and not env.single_gpu_gloo():
            raise MoeEpUsageError(
                f"world size {spec.world_size} spawns one rank per CUDA device, but "
                f"{count} are visible (CUDA_VISIBLE_DEVICES={env.cuda_visible_devices()}); "
                f"use --world-size <= {count}, or MEGA_SINGLE_GPU_GLOO=1 to let ranks share "
                "GPUs (gloo)"
            )
        for warning in capacity_warnings(spec, on_cuda=count > 0):
            print(f"moe-ep: warning: {warning}", file=sys.stderr)
    for kernel in spec.kernels:
        kernel_cls, config = resolve_backend(kernel)
        ok, reason = kernel_cls.availability()
        if not ok:  # before spawning: exit 3 with the reason, not a rank's traceback
            raise MoeEpUnavailableError(f"kernel {kernel!r} cannot run here: {reason}")
        make_recipe = getattr(kernel_cls, "make_recipe", None)
        if make_recipe is not None:
            make_recipe(config).check_dims(spec.hidden, spec.intermediate)


def execute(spec: JobSpec) -> tuple[JobSpec, list[dict[str, Any]]]:
    """Run `spec` on local spawned ranks, or in-process under torchrun; merged per kernel.

    Under torchrun the launcher's world size wins over `spec.world_size` (the spec actually
    run is returned) and every rank gets the merged rows of all ranks.
    """
    launched = _torchrun_rank_and_world_size()
    if launched is not None:
        rank, ws = launched
        spec = JobSpec(**{**asdict(spec), "world_size": ws, "kernels": spec.kernels})
    preflight(spec)
    if launched is not None:
        per_rank: list[Any] = run_job(rank, ws, spec, True)
    else:
        from moe_ep import spawn
        from moe_ep.cli.exits import rank_failure_error

        run = spawn.launch_local(run_job, spec.world_size, spec, timeout_s=600)
        if not run.ok:  # one line of the root cause's kind; its cause has the tracebacks
            raise rank_failure_error(run) from run.error()
        per_rank = run.values()
    merged = []
    for j, kernel in enumerate(spec.kernels):
        rows = [r[j] for r in per_rank]
        worst = max(rows, key=lambda r: r.get("ratio", 0.0))
        # A failing rank's detail: the check can fail globally on a rank whose band ratio
        # is not the largest.
        shown = next((r for r in rows if not r.get("ok", True)), worst)
        merged.append(
            {
                "kernel": kernel,
                "seconds": max(r["seconds"] for r in rows),
                "ratio": worst.get("ratio"),
                "global_ratio": max(
                    (r["global_ratio"] for r in rows if "global_ratio" in r), default=None
                ),
                "ok": all(r.get("ok", True) for r in rows),
                "detail": f"rank {shown['rank']}: {shown.get('detail', '')}",
            }
        )
    return spec, merged


def _table(spec: JobSpec, merged: list[dict[str, Any]], device: str) -> Any:
    from rich.table import Table

    title = (
        f"moe-ep {device}: EP{spec.world_size}, {spec.tokens} tokens/rank, H={spec.hidden}, "
        f"I={spec.intermediate}, E={spec.experts}, k={spec.topk}, {spec.routing} routing"
    )
    table = Table(title=title)
    columns = ("kernel", "max err / band", "rel err / bound", "check", "time / forward", "tokens/s")
    for col in columns:
        table.add_column(col, justify="left" if col == "kernel" else "right", no_wrap=True)
    total = spec.tokens * spec.world_size
    for row in merged:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.3f}"
        global_ratio = "-" if row.get("global_ratio") is None else f"{row['global_ratio']:.3f}"
        check = "-" if row["ratio"] is None else ("ok" if row["ok"] else "FAIL")
        table.add_row(
            row["kernel"],
            ratio,
            global_ratio,
            check,
            f"{row['seconds'] * 1e3:.2f} ms",
            f"{total / row['seconds']:,.0f}" if row["seconds"] > 0 else "-",
        )
    return table


def _report(spec: JobSpec, merged: list[dict[str, Any]], *, info: bool) -> int:
    import torch
    from rich.console import Console

    launched = _torchrun_rank_and_world_size()
    if launched is not None and launched[0] != 0:
        return EXIT_OK if all(r["ok"] for r in merged) else EXIT_CHECK_FAILED
    console = Console()
    if console.width < 112:  # not a terminal: keep kernel names and columns whole
        console = Console(width=112)
    if info:
        from moe_ep.cli.report import print_info

        print_info(console)
    device = "CUDA/NCCL" if torch.cuda.is_available() else "CPU/gloo"
    console.print(_table(spec, merged, device))
    failed = [r for r in merged if not r["ok"]]
    for row in failed:
        console.print(f"[red]check failed[/red] {row['kernel']}: {row['detail']}")
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def _demo_world_size() -> int:
    """2 ranks, except on a machine with one CUDA device (NCCL wants a GPU per rank) unless
    MEGA_SINGLE_GPU_GLOO=1 lets ranks share it: there 1."""
    import torch

    from moe_ep import env

    one_gpu = torch.cuda.is_available() and torch.cuda.device_count() < 2
    return 1 if one_gpu and not env.single_gpu_gloo() else 2


def _demo_kernels() -> tuple[str, ...]:
    import torch

    kernels = list(portable_kernels())
    if torch.cuda.is_available():
        from moe_ep.registry import available_kernels

        # "best": a GPU kernel of the newest arch listed as available, checkable by format.
        formats = oracle_formats()
        gpu = [
            info
            for info in available_kernels()
            if info.available
            and info.taxonomy is not None
            and info.taxonomy.arch != "any"
            and (info.taxonomy.act, info.taxonomy.weight) in formats
        ]
        gpu.sort(
            key=lambda info: (
                int("".join(c for c in info.taxonomy.arch if c.isdigit()) or 0)
                if info.taxonomy
                else 0
            )
        )
        if gpu:
            kernels.append(gpu[-1].name)
    return tuple(kernels)


def add_parsers(sub: Any) -> None:
    """Add `demo` and `run` to the `moe-ep` sub-command parser."""
    demo = sub.add_parser(
        "demo",
        help="every portable format (+ the best GPU kernel) on 2 ranks vs the oracle",
        description="Run every portable format on 2 local ranks (1 on a machine with one "
        "GPU) on a small DeepSeek-like shape, check each against the oracle and print one "
        "table. Exit 1 if a check fails.",
    )
    demo.add_argument("--iters", type=int, default=3, help="timed forwards per kernel (3)")
    run = sub.add_parser(
        "run",
        help="one kernel on any shape (spawns local ranks, or runs under torchrun)",
        description="Run one kernel on a synthetic problem; --check compares with the oracle "
        "(exit 1 if it fails). Each rank builds only its shard of the problem; a warning "
        "comes first when the ranks would not fit this machine's memory or cores. Under "
        "torchrun (RANK and WORLD_SIZE set) it runs in this process with env:// rendezvous "
        "and the launcher's world size.",
    )
    run.add_argument("--world-size", type=int, default=1, help="local ranks to spawn (1)")
    run.add_argument("--kernel", default=DEFAULT_KERNEL, help="kernel name (%(default)s)")
    run.add_argument("--tokens", type=int, default=128, help="tokens per rank (128)")
    run.add_argument("--hidden", type=int, default=1024, help="H (1024)")
    run.add_argument("--intermediate", type=int, default=512, help="I (512)")
    run.add_argument("--experts", type=int, default=16, help="E (16)")
    run.add_argument("--topk", type=int, default=4, help="k (4)")
    run.add_argument("--routing", choices=("uniform", "skewed"), default="uniform")
    run.add_argument("--check", action="store_true", help="compare with the oracle")
    run.add_argument("--iters", type=int, default=5, help="timed forwards (5)")
    run.add_argument("--seed", type=int, default=0)


def run_command(args: argparse.Namespace) -> int:
    """Run `demo` or `run`; returns the exit code (1 when a check fails)."""
    if args.command == "demo":
        ws = _demo_world_size()
        spec = JobSpec(kernels=_demo_kernels(), world_size=ws, iters=args.iters, **DEMO_SHAPE)
        spec.validate()
        from moe_ep.cli.report import print_info

        print_info()
        return _report(*execute(spec), info=False)
    if args.command == "run":
        from moe_ep.registry import resolve_kernel_name

        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", DeprecationWarning)
                kernel = resolve_kernel_name(args.kernel)
        except KeyError as exc:
            raise MoeEpUsageError(str(exc).strip("'\"")) from None
        for warning in caught:  # a deprecated alias: say so, the CLI hides no warning
            print(f"moe-ep: warning: {warning.message}", file=sys.stderr)
        spec = JobSpec(
            kernels=(kernel,),
            world_size=args.world_size,
            tokens=args.tokens,
            hidden=args.hidden,
            intermediate=args.intermediate,
            experts=args.experts,
            topk=args.topk,
            routing=args.routing,
            check=args.check,
            iters=args.iters,
            seed=args.seed,
        )
        if spec.check:
            oracle_format(kernel)
        return _report(*execute(spec), info=False)
    raise MoeEpUsageError(f"unknown command {args.command!r}")

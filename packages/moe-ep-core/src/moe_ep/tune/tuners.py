"""The kernels' tuners: each candidate config's layer timed on the problem, inputs restaged
for every routing; `tune_rank` runs one rank's sweep (process group acquired once, released
at the end)."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_ep.errors import MoeEpUsageError
from moe_ep.tune.sweep import Candidate, Winner, run_sweep
from moe_ep.tuning.knobs import candidates, grid_of


@dataclass(frozen=True)
class TuneJob:
    """One kernel on one problem (picklable: sent to every spawned rank)."""

    kernel: str
    tokens: int
    hidden: int
    inter: int
    experts: int
    topk: int
    routings: tuple[str, ...]
    reps: int
    warmup: int
    cache: str
    threads: int | None = None


def valid_grid(kernel_cls: Any, world_size: int) -> list[dict[str, Any]]:
    """The kernel's knob grid at `world_size` without the candidates its config class
    refuses.

    Raises:
        MoeEpUsageError: the kernel declares no knobs at that world size.
    """
    from moe_ep.tuning.lookup import apply_knobs

    grid = dict(grid_of(kernel_cls.kernel_name, world_size))
    if not grid:
        raise MoeEpUsageError(
            f"--kernel {kernel_cls.kernel_name!r} has no tuning knobs at --ep {world_size}"
        )
    if "cpu_threads" in grid and not _threads_keep_bits():
        grid["cpu_threads"] = (None,)  # the thread count would change the bits: not a knob
    base = kernel_cls.config_cls()
    out = []
    for cand in candidates(grid):
        try:
            apply_knobs(base, cand)
        except MoeEpUsageError:
            continue
        out.append(cand)
    return out


def _threads_keep_bits() -> bool:
    """Whether the portable forward's bits are the same at every thread count here (on a
    CUDA machine the kernel refuses `cpu_threads`: not a knob there either)."""
    import torch

    from moe_ep.backends.portable.kernel import thread_count_keeps_bits

    return not torch.cuda.is_available() and thread_count_keeps_bits()


def layer_measure(
    job: TuneJob, rank: int, world_size: int, boot: Any, runtime: Any
) -> Callable[[Candidate], float]:
    """This rank's median seconds of a forward per candidate config, summed over the
    routings (each restaged: new tokens, new routing), after warm-up, every timed run
    started together (barrier)."""
    from moe_ep import FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep.bench.harness import problem_spec
    from moe_ep.bench.shapes import BenchShape
    from moe_ep.bench.timing import round_robin
    from moe_ep.cli.problem import expert_weights, rank_tokens
    from moe_ep.registry import get_kernel
    from moe_ep.tuning.lookup import apply_knobs

    kernel_cls: Any = get_kernel(job.kernel)
    el = job.experts // world_size
    shape = BenchShape("tune", job.tokens, job.hidden, job.inter, job.experts, job.topk)
    specs = [problem_spec(shape, world_size, r, job.kernel) for r in job.routings]
    w13, w2 = expert_weights(specs[0], list(range(rank * el, (rank + 1) * el)))
    dev = runtime.device
    w13, w2 = w13.to(dev), w2.to(dev)
    inputs = [{k: v.to(dev) for k, v in rank_tokens(s, rank).items()} for s in specs]
    barrier = runtime.barrier if world_size > 1 else None

    def measure(cand: Candidate) -> float:
        try:
            config = apply_knobs(kernel_cls.config_cls(), dict(cand))
        except MoeEpUsageError:
            return float("inf")
        fleet = FleetParams(job.experts, job.tokens, job.hidden)
        layer = MoEEpLayer(boot, fleet, MoEWeightPack(w13, w2), config)
        try:
            total = 0.0
            for t in inputs:
                tensors = MoEEpTensors(t["x"], t["ids"], t["topk_weights"])
                fwd = functools.partial(layer, tensors)
                got = round_robin(
                    {"layer": fwd}, job.reps, warmup=job.warmup, barrier=barrier, device=dev
                )
                total += statistics.median(got["layer"].runs)
            return total
        finally:
            layer.destroy()

    return measure


def tune_rank(
    rank: int,
    world_size: int,
    job: TuneJob,
    measure_factory: Callable[..., Callable[[Candidate], float]] | None = None,
) -> Winner:
    """One rank's tuning (top level so it can be spawned): acquire the group, agree on the
    token bucket, sweep, release. `measure_factory` (tests: fake timings) replaces
    `layer_measure`."""
    import torch

    from moe_ep import BootstrapConfig
    from moe_ep.bench.progress import Steps
    from moe_ep.device import usable_cpus
    from moe_ep.registry import get_kernel
    from moe_ep.runtime import acquire
    from moe_ep.spawn import free_port
    from moe_ep.tune.sweep import agreed_tokens
    from moe_ep.tuning.cache import TuningCache
    from moe_ep.tuning.lookup import key_for

    if job.threads is not None:
        torch.set_num_threads(job.threads)
    elif not torch.cuda.is_available():  # ranks share the cores: one thread share each
        torch.set_num_threads(max(1, usable_cpus() // world_size))
    kernel_cls = get_kernel(job.kernel)
    grid = valid_grid(kernel_cls, world_size)
    init = f"tcp://127.0.0.1:{free_port()}" if world_size == 1 else None
    boot = BootstrapConfig(world_size, rank, init_method=init)
    rt = acquire(boot)
    try:
        tokens = agreed_tokens(rt, job.tokens)
        dev = rt.device
        ordinal = dev.index if dev.type == "cuda" else None
        key = key_for(kernel_cls, tokens, job.hidden, job.inter, job.experts, world_size, ordinal)
        factory = measure_factory or layer_measure
        measure = factory(job, rank, world_size, boot, rt)
        steps = Steps(len(grid), live=None if world_size == 1 else False)
        say = steps.step if rank == 0 else (lambda what: None)
        with steps:
            return run_sweep(rt, key, grid, measure, TuningCache(Path(job.cache)), say)
    finally:
        rt.release()

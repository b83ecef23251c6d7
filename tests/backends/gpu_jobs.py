"""Spawned workers of the GPU tests (top-level so they pickle): jobs through `MoEEpLayer`.

A `Job` runs one `GpuCase` (`sm90_gpu_cases.problem_for`) through a kernel, or through a
given backend (a CPU twin). All jobs of one call run in one process per rank, which holds
one runtime across them as a host process holds it across its layers (one NVSHMEM
initialisation; layers of one geometry share the pooled compiled kernel).

A job may `repeat`: one layer forwards the same tokens fully routed first (every combine
cell written) and then with the case's padded slots; only the second output is compared.
On a GPU that catches a padded slot summing a cell an earlier launch left. A job may have a
`decoy`: a layer of the same geometry with other weights (seed + 100), built and run first
and kept alive, so the compared layer shares its pooled kernel and buffers; on a GPU that
catches a layer launched with another layer's weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from sm90_gpu_cases import CASES, GpuCase, problem_for


@dataclass(frozen=True)
class Job:
    """One comparison: `case` through `kernel` (or `backend`, its CPU twin); `repeat` and
    `decoy` as in the module docstring."""

    case: GpuCase
    kernel: str
    backend: Any = None
    repeat: bool = False
    decoy: bool = False


EP1_JOBS: dict[str, tuple[GpuCase, bool, bool]] = {
    **{c.name: (c, False, False) for c in CASES},
    "padded_after_full": (CASES[1], True, False),  # repeat
    "two_layers": (CASES[0], False, True),  # decoy
}
"""The EP1 problems of the GPU tests by name: (case, repeat, decoy)."""


def ep1_jobs(
    kernel: str, backend: Any = None, shrink: Callable[[GpuCase], GpuCase] | None = None
) -> dict[str, Job]:
    """`EP1_JOBS` through `kernel` (or `backend`), each case passed through `shrink`."""
    return {
        name: Job(shrink(c) if shrink else c, kernel, backend, repeat=r, decoy=d)
        for name, (c, r, d) in EP1_JOBS.items()
    }


BackendOf = Callable[[GpuCase, str], Any]
"""A module-level function (it travels to the ranks): the layer's backend for a job without
one (the kernel's config, e.g. with `top_k` so `warmup()` compiles ahead)."""


def _inputs(case: GpuCase, rank: int, world_size: int, kernel: str, dev: Any) -> Any:
    from moe_ep import MoEEpTensors

    p = problem_for(case, world_size, kernel)
    rows = slice(rank * case.tokens, (rank + 1) * case.tokens)
    return MoEEpTensors(
        hidden_states=p["x"][rows].to(dev),
        topk_ids=p["ids"][rows].to(dev),
        topk_weights=p["w"][rows].to(dev),
    )


def _layer(rank: int, world_size: int, case: GpuCase, job: Job, backend_of: BackendOf) -> Any:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEWeightPack

    p = problem_for(case, world_size, job.kernel)
    el = case.experts_per_rank
    experts = slice(rank * el, (rank + 1) * el)
    return MoEEpLayer(
        BootstrapConfig(world_size=world_size, rank=rank),
        FleetParams(
            num_experts=el * world_size,
            max_tokens_per_rank=max(case.tokens, 1),  # n == 0 still needs a legal buffer
            hidden_size=case.hidden,
        ),
        MoEWeightPack(w13=p["w13"][experts], w2=p["w2"][experts]),
        job.backend if job.backend is not None else backend_of(case, job.kernel),
    )


def run_job(rank: int, world_size: int, job: Job, backend_of: BackendOf) -> torch.Tensor:
    """One rank's output `[tokens, H]` bf16 (on CPU) for `job` through a `MoEEpLayer`."""
    case, kernel = job.case, job.kernel
    layers = []
    try:
        if job.decoy:  # same geometry, other weights; stays alive
            other = replace(case, seed=case.seed + 100)
            layers.append(_layer(rank, world_size, other, job, backend_of))
            layers[-1].warmup()
            layers[-1].forward(_inputs(other, rank, world_size, kernel, layers[-1].device))
        layers.append(_layer(rank, world_size, case, job, backend_of))
        layer = layers[-1]
        layer.warmup()
        dev = layer.device
        if job.repeat:  # same tokens and weights (same seed), every slot routed
            layer.forward(_inputs(replace(case, pad_frac=0.0), rank, world_size, kernel, dev))
        out = layer.forward(_inputs(case, rank, world_size, kernel, dev))
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        return out.cpu()
    finally:
        for layer in reversed(layers):
            layer.destroy()


def run_jobs_wire(
    rank: int, world_size: int, jobs: list[Job], backend_of: BackendOf
) -> list[np.ndarray]:
    """`run_job` for each job in order, as a `spawn_local` worker: the bf16 outputs' bits as
    int16 numpy (torch's shared-memory pickling races the rank's exit). One runtime reference
    is held across the jobs (otherwise each job would tear the process group down and
    rendezvous again)."""
    from moe_ep import BootstrapConfig
    from moe_ep.runtime import acquire

    runtime = acquire(BootstrapConfig(world_size=world_size, rank=rank))
    try:
        return [
            run_job(rank, world_size, j, backend_of).contiguous().view(torch.int16).numpy()
            for j in jobs
        ]
    finally:
        runtime.release()


def job_outputs(
    jobs: list[Job], world_size: int, backend_of: BackendOf, *, timeout_s: float = 600.0
) -> list[torch.Tensor]:
    """Run `jobs` on `world_size` spawned ranks (one process per rank runs them all); each
    job's output gathered over the ranks, `[world_size * tokens, H]` bf16, in job order.

    Jobs with a CPU twin run on CPU also where GPUs are visible (the GPU check runs the CPU
    rehearsals too, often with fewer GPUs than ranks); mixing twins and kernels in one call
    is refused.
    """
    from moe_ep.spawn import spawn_local

    twins = {j.backend is not None for j in jobs}
    if len(twins) != 1:
        raise ValueError("jobs must all have a CPU twin backend, or none")
    env = {"CUDA_VISIBLE_DEVICES": ""} if twins == {True} else None
    outs = spawn_local(run_jobs_wire, world_size, jobs, backend_of, timeout_s=timeout_s, env=env)
    return [
        torch.cat([torch.from_numpy(rank_outs[i]).view(torch.bfloat16) for rank_outs in outs])
        for i in range(len(jobs))
    ]

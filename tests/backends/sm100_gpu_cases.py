"""Oracle, CPU twins and spawned workers of the sm100 GPU tests (top-level so they pickle).

The problems are `sm90_gpu_cases`' (`problem_for`: fp8-exact weights for the sm100
kernels). Both sm100 CuTe DSL kernels apply the top-k weight before quantizing the FC2
input (`apply_topk_in_fc1`), so the oracle runs with `topk_weight_before_fc2=True` and the
CPU twin is the portable backend of the same format with that knob: it computes as the
oracle does, so `test_sm100_gpu_cases.py` runs the GPU tests' code path on CPU
(`sm100_reports`), and a slip in it fails there rather than in scarce GPU minutes.

A job may `repeat`: one layer forwards the same tokens fully routed first (every combine
cell written) and then with the case's padded slots; only the second output is compared.
On a GPU that catches a padded slot summing a cell an earlier launch left. A job may have a
`decoy`: a layer of the same geometry with other weights (seed + 100), built and run first
and kept alive, so the compared layer shares its pooled kernel and buffers; on a GPU that
catches a layer launched with another layer's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from sm90_gpu_cases import GpuCase, problem_for

NVFP4 = "sm100_nvfp4_nvfp4_bf16_cutedsl"
MXFP8 = "sm100_mxfp8_mxfp8_bf16_cutedsl"
FORMATS = {NVFP4: "nvfp4", MXFP8: "mxfp8"}


@dataclass(frozen=True)
class Job:
    """One comparison: `case` through `kernel` (or `backend`, its CPU twin); `repeat` and
    `decoy` as in the module docstring."""

    case: GpuCase
    kernel: str
    backend: Any = None
    repeat: bool = False
    decoy: bool = False


def sm100_oracle(case: GpuCase, world_size: int, kernel: str) -> Any:
    """`oracle_forward` of `case` in `kernel`'s format, top-k weight before FC2 (the
    kernels' `apply_topk_in_fc1`); nvfp4 with the configs' default global scales (1.0)."""
    from moe_ep.oracle import oracle_forward

    p = problem_for(case, world_size, kernel)
    return oracle_forward(
        p["x"], p["ids"], p["w"], p["w13"], p["w2"], fmt=FORMATS[kernel],
        topk_weight_before_fc2=True,
    )  # fmt: skip


def cpu_twin(kernel: str) -> Any:
    """The portable config that computes as the oracle call of `sm100_oracle` (runs on CPU)."""
    from moe_ep.backends.portable.configs import (
        Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig,
        Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig,
    )

    if kernel == NVFP4:
        return Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig(topk_weight_before_fc2=True)
    return Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig(topk_weight_before_fc2=True)


def sm100_backend(case: GpuCase, kernel: str) -> Any:
    """What the GPU tests build the layer with: the kernel's config with `top_k` (so
    `warmup()` compiles ahead, collectively)."""
    from moe_ep_sm100 import (
        Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
        Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    )

    if kernel == NVFP4:
        return Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig(top_k=case.topk)
    return Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig(top_k=case.topk)


def _inputs(case: GpuCase, rank: int, world_size: int, kernel: str, dev: Any) -> Any:
    from moe_ep import MoEEpTensors

    p = problem_for(case, world_size, kernel)
    rows = slice(rank * case.tokens, (rank + 1) * case.tokens)
    return MoEEpTensors(
        hidden_states=p["x"][rows].to(dev),
        topk_ids=p["ids"][rows].to(dev),
        topk_weights=p["w"][rows].to(dev),
    )


def _layer(rank: int, world_size: int, case: GpuCase, job: Job) -> Any:
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
        job.backend if job.backend is not None else sm100_backend(case, job.kernel),
    )


def run_job(rank: int, world_size: int, job: Job) -> torch.Tensor:
    """One rank's output `[tokens, H]` bf16 (on CPU) for `job` through a `MoEEpLayer`."""
    case, kernel = job.case, job.kernel
    layers = []
    try:
        if job.decoy:  # same geometry, other weights; stays alive
            other = replace(case, seed=case.seed + 100)
            layers.append(_layer(rank, world_size, other, job))
            layers[-1].warmup()
            layers[-1].forward(_inputs(other, rank, world_size, kernel, layers[-1].device))
        layers.append(_layer(rank, world_size, case, job))
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


def run_jobs_wire(rank: int, world_size: int, jobs: list[Job]) -> list[np.ndarray]:
    """`run_job` for each job in order, as a `spawn_local` worker: the bf16 outputs' bits as
    int16 numpy (torch's shared-memory pickling races the rank's exit). One runtime reference
    is held across the jobs, as a host process holds it across its layers (otherwise each
    job would tear the process group down and rendezvous again)."""
    from moe_ep import BootstrapConfig
    from moe_ep.runtime import acquire

    runtime = acquire(BootstrapConfig(world_size=world_size, rank=rank))
    try:
        return [run_job(rank, world_size, j).contiguous().view(torch.int16).numpy() for j in jobs]
    finally:
        runtime.release()


def sm100_reports(jobs: list[Job], world_size: int, *, timeout_s: float = 600.0) -> list[Any]:
    """Run `jobs` on `world_size` spawned ranks (one process per rank runs them all) and
    compare each gathered output with `sm100_oracle`; the `ToleranceReport`s in job order.

    Jobs with a CPU twin run on CPU also where GPUs are visible; mixing twins and kernels in
    one call is refused.
    """
    from moe_ep.launch import spawn_local
    from moe_ep.oracle import compare_to_oracle

    twins = {j.backend is not None for j in jobs}
    if len(twins) != 1:
        raise ValueError("jobs must all have a CPU twin backend, or none")
    env = {"CUDA_VISIBLE_DEVICES": ""} if twins == {True} else None
    outs = spawn_local(run_jobs_wire, world_size, jobs, timeout_s=timeout_s, env=env)
    reports = []
    for i, job in enumerate(jobs):
        got = torch.cat([torch.from_numpy(rank_outs[i]).view(torch.bfloat16) for rank_outs in outs])
        reports.append(compare_to_oracle(got, sm100_oracle(job.case, world_size, job.kernel)))
    return reports

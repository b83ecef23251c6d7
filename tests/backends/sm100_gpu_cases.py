"""Oracle, CPU twins and spawned workers of the sm100 GPU tests (top-level so they pickle).

The problems are `sm90_gpu_cases`' (`problem_for`: fp8-exact weights for the sm100
kernels). The sm100 CuTe DSL kernels apply the top-k weight before quantizing the FC2
input (`apply_topk_in_fc1`; the mxfp8 x mxfp4 kernel's `apply_topk_at_fc1`), so the oracle
runs with `topk_weight_before_fc2=True` and the CPU twin is the portable backend of the same
format with that knob: it computes as the oracle does, so `test_sm100_gpu_cases.py` runs
the GPU tests' code path on CPU (`sm100_reports`), and a slip in it fails there rather than
in scarce GPU minutes.

Jobs (`gpu_jobs.Job`: a case through a kernel or a twin, optionally `repeat` / `decoy`)
run in one spawned process per rank (`gpu_jobs.job_outputs`).
"""

from __future__ import annotations

from typing import Any

from gpu_jobs import Job, job_outputs
from sm90_gpu_cases import GpuCase, problem_for

NVFP4 = "sm100_nvfp4_nvfp4_bf16_cutedsl"
MXFP8 = "sm100_mxfp8_mxfp8_bf16_cutedsl"
MXFP8_MXFP4 = "sm100_mxfp8_mxfp4_bf16_cutedsl"
FORMATS = {NVFP4: "nvfp4", MXFP8: "mxfp8", MXFP8_MXFP4: "mxfp8_mxfp4"}


def sm100_oracle(case: GpuCase, world_size: int, kernel: str) -> Any:
    """`oracle_forward` of `case` in `kernel`'s format, top-k weight before FC2 (the
    kernels' `apply_topk_in_fc1`); nvfp4 with the configs' default global scales (1.0)."""
    from moe_ep.oracle import oracle_forward

    p = problem_for(case, world_size, kernel)
    return oracle_forward(
        p["x"], p["ids"], p["w"], p["w13"], p["w2"], fmt=FORMATS[kernel],
        apply_routing_weights_before_fc2=True,
    )  # fmt: skip


def cpu_twin(kernel: str) -> Any:
    """The portable config that computes as the oracle call of `sm100_oracle` (runs on CPU)."""
    from moe_ep.backends.portable.configs import (
        Any_Mxfp8_Mxfp4_Bf16_Torch_MegaMoeConfig,
        Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig,
        Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig,
    )

    twins = {
        NVFP4: Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig,
        MXFP8: Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig,
        MXFP8_MXFP4: Any_Mxfp8_Mxfp4_Bf16_Torch_MegaMoeConfig,
    }
    return twins[kernel](apply_routing_weights_before_fc2=True)


def sm100_backend(case: GpuCase, kernel: str) -> Any:
    """What the GPU tests build the layer with: the kernel's config with `top_k` (so
    `warmup()` compiles ahead, collectively)."""
    from moe_ep_sm100 import (
        Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig,
        Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
        Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    )

    configs = {
        NVFP4: Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
        MXFP8: Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
        MXFP8_MXFP4: Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig,
    }
    return configs[kernel](top_k=case.topk)


def sm100_reports(jobs: list[Job], world_size: int, *, timeout_s: float = 600.0) -> list[Any]:
    """Run `jobs` on `world_size` spawned ranks (`gpu_jobs.job_outputs`) and compare each
    gathered output with `sm100_oracle`; the `ToleranceReport`s in job order."""
    from moe_ep.oracle import compare_to_oracle

    outs = job_outputs(jobs, world_size, sm100_backend, timeout_s=timeout_s)
    return [
        compare_to_oracle(got, sm100_oracle(job.case, world_size, job.kernel))
        for job, got in zip(jobs, outs, strict=True)
    ]

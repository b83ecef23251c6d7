"""The sm100 GPU tests' CPU-side code, run on CPU with each kernel replaced by its twin.

`test_sm100_gpu.py` skips here (no Blackwell GPU). This runs its code path
(`sm100_gpu_cases.sm100_reports`: spawned ranks through `MoEEpLayer`, gathered outputs
against `sm100_oracle`) with `cpu_twin(kernel)` (the portable nvfp4 / mxfp8 / mxfp8 x
mxfp4 backend with the top-k weight before FC2, as the kernels apply it) on the same cases
at CPU size, at EP2, in one spawn, so a slip in the problems, the oracle call, the worker or
the comparison fails here rather than on the first GPU run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from sm90_gpu_cases import CASES, GpuCase
from sm100_gpu_cases import FORMATS, Job, cpu_twin, sm100_backend, sm100_reports


def _small(case: GpuCase) -> GpuCase:
    return replace(case, hidden=256, inter=128, tokens=min(case.tokens, 6))


@pytest.mark.multirank
def test_cpu_twins_match_the_gpu_tests_oracle_ep2() -> None:
    jobs = [Job(_small(c), k, cpu_twin(k)) for k in sorted(FORMATS) for c in CASES]
    jobs += [Job(_small(CASES[1]), k, cpu_twin(k), repeat=True) for k in sorted(FORMATS)]
    jobs += [Job(_small(CASES[0]), k, cpu_twin(k), decoy=True) for k in sorted(FORMATS)]
    reports = sm100_reports(jobs, 2, timeout_s=120)
    for job, report in zip(jobs, reports, strict=True):
        assert report.ok, f"{job}: {report}"


def test_the_gpu_jobs_build_the_kernels_config_with_top_k() -> None:
    # what the GPU jobs (no twin) hand to MoEEpLayer: the kernel's own config, top_k set so
    # warmup() compiles; it resolves to the kernel it is compared as
    from moe_ep.registry import resolve_kernel_name

    for kernel in FORMATS:
        cfg = sm100_backend(CASES[2], kernel)
        assert resolve_kernel_name(cfg.kernel_name) == kernel
        assert cfg.top_k == CASES[2].topk

"""sm90 kernels against the oracle on a Hopper GPU (skipped elsewhere, with the reason).

Never run on a GPU yet.

Weights are ordinary random ones; the oracle quantizes them with each kernel's own recipe
(`sm90_gpu_cases.SM90_RECIPES`: for the pull kernel FC1 interleaved by 8 before its 128x128
blocks, the FC2 input in 1x64 blocks and the top-k weight before it; for the push kernel
canonical gate-then-up blocks and 1x128), so it computes with the kernel's
weight values bit for bit and the remaining differences are accumulation order and
requantization flips, which the tolerance band covers. The push kernel's bf16 intermediates
(FC1 output, SwiGLU output, FC2 output, combine partials) move its outputs by up to about a
band width on their own, so its runs are compared with `push_reference` (the drop's steps)
inside the oracle's band (`sm90_gpu_cases.sm90_reference`). The same problems, oracle calls and
worker run on CPU against each kernel's portable twin in `test_sm90_gpu_cases.py`.

The bf16 pull kernel quantizes nothing; its oracle keeps the FC1 output unrounded into
SwiGLU and weights the SwiGLU output before its bf16 rounding (`SM90_RECIPES[BF16_PULL]`),
the recipe its drop's own reference passes on CPU at these sizes, EP1 and EP2
(`test_drop_reference_conformance.py`). Its CPU twin `any_bf16_bf16_bf16_torch` with
`fc1_output_high_precision=True` and the top-k weight before FC2 runs the same jobs on CPU
(`test_sm90_gpu_cases.py`) and passes against the drop's reference too.

The MXFP4 pull kernel's oracle is `fmt="fp8_mxfp4"` with its config's clamp and the top-k
weight before FC2 (`SM90_RECIPES[MXFP4_PULL]`); its drop ships no reference, and its CPU
twin `any_fp8_mxfp4_bf16_torch` runs the same jobs on CPU (`test_sm90_gpu_cases.py`). Its
weights reach the kernel folded into the tiles `tile_fold` derives from the drop's
mainloop (checked on CPU against a restatement of it, never against the hardware: a wrong
fold fails every job here by far more than the band).

The NVFP4 pull kernel's oracle is `fmt="fp8_nvfp4"` (`SM90_RECIPES[NVFP4_PULL]`), its CPU
twin `any_fp8_nvfp4_bf16_torch`; its weights reach the kernel K-permuted (`nvfp4_kperm`,
default 64, the staged activations alike) and in the MXFP4 kernel's tiles, which its
conversion reads through the same LDSM views (checked on CPU only, as above).
"""

from __future__ import annotations

import functools

import pytest
import torch
from backend_hw import require_capability
from backend_testing import assert_gpu_staging_equals_cpu
from gpu_jobs import EP1_JOBS, Job, ep1_jobs
from sm90_gpu_cases import (
    BF16_PULL,
    CASES,
    MXFP4_PULL,
    NVFP4_PULL,
    PULL,
    PUSH,
    GpuCase,
    problem_for,
    sm90_reports,
)

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]


def _availability(kernel: str) -> tuple[bool, str]:
    from moe_ep.registry import get_kernel

    return get_kernel(kernel).availability()


@functools.cache
def _ep1_reports(kernel: str) -> dict[str, object] | Exception:
    """Every `EP1_JOBS` job through `kernel` in one spawned process (one NVSHMEM set-up;
    jobs of one geometry share the compile: the GPU minutes are few). A failure is kept and
    re-raised by each test instead of running the whole set again."""
    jobs = ep1_jobs(kernel)
    try:
        return dict(zip(jobs, sm90_reports(list(jobs.values()), 1, timeout_s=600.0), strict=True))
    except Exception as exc:
        return exc


def _check_ep1(name: str, kernel: str) -> None:
    require_capability((9, 0), "Hopper (sm_90)")
    ok, why = _availability(kernel)
    if not ok:
        pytest.skip(f"{kernel}: {why}")
    reports = _ep1_reports(kernel)
    if isinstance(reports, Exception):
        raise reports
    report = reports[name]
    assert report.ok, f"{kernel} {name}: {report}"


def _check(case: GpuCase, world_size: int, kernel: str) -> None:
    ok, why = _availability(kernel)
    if not ok:
        pytest.skip(f"{kernel}: {why}")
    (report,) = sm90_reports([Job(case, kernel)], world_size, timeout_s=600.0)
    assert report.ok, f"{case.name}: {report}"


@pytest.mark.parametrize("kernel", [PULL, BF16_PULL, MXFP4_PULL, NVFP4_PULL])
@pytest.mark.parametrize("name", list(EP1_JOBS))
def test_pull_matches_oracle_ep1(name, kernel):
    _check_ep1(name, kernel)


@pytest.mark.multirank
@pytest.mark.parametrize("kernel", [PULL, BF16_PULL, MXFP4_PULL, NVFP4_PULL])
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.name)
def test_pull_matches_oracle_multirank(case, kernel):
    require_capability((9, 0), "Hopper (sm_90)")
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2+ Hopper GPUs, {n} visible")
    _check(case, min(n, 4), kernel)


def _require_push_build() -> None:
    from moe_ep_sm90 import env

    if not env.push_build_enabled():
        pytest.skip(
            "the push kernel builds its TVM-FFI modules with nvcc on first use (minutes); "
            "set MOE_EP_PUSH_BUILD=1 to run its GPU tests"
        )


@pytest.mark.parametrize("name", list(EP1_JOBS))
def test_push_matches_oracle_ep1(name):
    # Never run. Canonical 128x128 weights (SM90_RECIPES[PUSH]), push_reference's roundings.
    require_capability((9, 0), "Hopper (sm_90)")
    _require_push_build()
    _check_ep1(name, PUSH)


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.name)
def test_push_matches_oracle_multirank(case):
    require_capability((9, 0), "Hopper (sm_90)")
    _require_push_build()
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2+ Hopper GPUs, {n} visible")
    _check(case, min(n, 4), PUSH)


def test_pull_staging_on_gpu_matches_cpu_bytes():
    require_capability((9, 0), "Hopper (sm_90)")
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.layout import stage_pull_inputs

    p = problem_for(GpuCase("staging", pad_frac=0.2), 1, PULL)
    cpu = stage_pull_inputs(p["x"], p["ids"], p["w"], max_tokens=128)
    gpu = stage_pull_inputs(p["x"].cuda(), p["ids"].cuda(), p["w"].cuda(), max_tokens=128)
    assert torch.equal(gpu.activation.cpu().view(torch.uint8), cpu.activation.view(torch.uint8))
    assert torch.equal(gpu.activation_scales.cpu(), cpu.activation_scales)
    assert torch.equal(gpu.topk_ids.cpu(), cpu.topk_ids)
    assert torch.equal(gpu.topk_weights.cpu(), cpu.topk_weights)


def test_bf16_pull_staging_on_gpu_matches_cpu_bytes():
    require_capability((9, 0), "Hopper (sm_90)")
    from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.layout import (
        prepare_bf16_pull_weights,
        stage_bf16_pull_inputs,
    )

    p = problem_for(GpuCase("staging", pad_frac=0.2), 1, BF16_PULL)
    cpu = stage_bf16_pull_inputs(p["x"], p["ids"], p["w"], max_tokens=128)
    gpu = stage_bf16_pull_inputs(p["x"].cuda(), p["ids"].cuda(), p["w"].cuda(), max_tokens=128)
    for got, want in zip(
        (gpu.activation, gpu.topk_ids, gpu.topk_weights),
        (cpu.activation, cpu.topk_ids, cpu.topk_weights),
        strict=True,
    ):
        assert torch.equal(got.cpu(), want)
    w_cpu = prepare_bf16_pull_weights(p["w13"], p["w2"])
    w_gpu = prepare_bf16_pull_weights(p["w13"].cuda(), p["w2"].cuda())
    assert w_gpu.w13.stride() == w_cpu.w13.stride() and w_gpu.w2.stride() == w_cpu.w2.stride()
    assert torch.equal(w_gpu.w13.cpu(), w_cpu.w13) and torch.equal(w_gpu.w2.cpu(), w_cpu.w2)


def test_mxfp4_pull_staging_and_weights_on_gpu_match_cpu_bytes():
    require_capability((9, 0), "Hopper (sm_90)")
    from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.layout import (
        mxfp4_pull_legs,
        stage_mxfp4_hybrid_inputs,
    )

    assert_gpu_staging_equals_cpu(stage_mxfp4_hybrid_inputs, 256)
    p = problem_for(GpuCase("staging"), 1, MXFP4_PULL)
    legs_cpu = mxfp4_pull_legs(p["w13"], p["w2"])
    legs_gpu = mxfp4_pull_legs(p["w13"].cuda(), p["w2"].cuda())
    for a, b in zip(legs_gpu, legs_cpu, strict=True):
        assert a.weight.stride() == b.weight.stride()
        for name in ("weight", "offsets", "scale"):
            assert torch.equal(getattr(a, name).cpu(), getattr(b, name)), name


@pytest.mark.parametrize("kperm", [0, 64])
def test_nvfp4_pull_staging_and_weights_on_gpu_match_cpu_bytes(kperm):
    require_capability((9, 0), "Hopper (sm_90)")
    from moe_ep.types import MoEWeightPack
    from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.layout import (
        nvfp4_pull_legs,
        stage_nvfp4_inputs,
    )

    p = problem_for(GpuCase("staging", pad_frac=0.2), 1, NVFP4_PULL)
    cpu = stage_nvfp4_inputs(p["x"], p["ids"], p["w"], max_tokens=128, kperm=kperm)
    gpu = stage_nvfp4_inputs(
        p["x"].cuda(), p["ids"].cuda(), p["w"].cuda(), max_tokens=128, kperm=kperm
    )
    assert torch.equal(gpu.activation.cpu().view(torch.uint8), cpu.activation.view(torch.uint8))
    for name in ("activation_scales", "topk_ids", "topk_weights"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    weights = MoEWeightPack(w13=p["w13"], w2=p["w2"])
    legs_cpu = nvfp4_pull_legs(weights, kperm=kperm)
    legs_gpu = nvfp4_pull_legs(weights.to("cuda"), kperm=kperm)
    for a, b in zip(legs_gpu, legs_cpu, strict=True):
        assert a.weight.stride() == b.weight.stride()
        for name in ("weight", "scales", "decode_x8"):
            assert torch.equal(getattr(a, name).cpu(), getattr(b, name)), name

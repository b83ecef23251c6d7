"""sm100 CuTe DSL kernels against the oracle on a Blackwell GPU (skipped elsewhere, with the
reason). Never run: no Blackwell GPU was available when they were written.

The problems are `sm90_gpu_cases`' (bf16 activations, weights exact in fp8, which the nvfp4
and mxfp8 recipes re-quantize with their own block scales, as the oracle does). Both kernels
apply the top-k weight before quantizing the FC2 input (`apply_topk_in_fc1`); the oracle
does the same with `topk_weight_before_fc2=True`.
"""

from __future__ import annotations

import pytest
import torch
from backend_hw import require_capability
from sm90_gpu_cases import CASES, GpuCase, problem_for, run_rank_wire

pytestmark = [pytest.mark.gpu, pytest.mark.sm100]

KERNELS = {
    "sm100_nvfp4_nvfp4_bf16_cutedsl": "nvfp4",
    "sm100_mxfp8_mxfp8_bf16_cutedsl": "mxfp8",
}


def _check(case: GpuCase, world_size: int, kernel: str) -> None:
    from moe_ep.launch import spawn_local
    from moe_ep.oracle import compare_to_oracle, oracle_forward
    from moe_ep.registry import get_kernel

    ok, why = get_kernel(kernel).availability()
    if not ok:
        pytest.skip(f"{kernel}: {why}")
    # numpy bits back from the ranks: torch's shared-memory pickling of a returned tensor
    # fails when the rank exits before the parent reads it
    outs = spawn_local(run_rank_wire, world_size, case, kernel, timeout_s=600.0)
    got = torch.cat([torch.from_numpy(a).view(torch.bfloat16) for a in outs])
    p = problem_for(case, world_size, kernel)
    ref = oracle_forward(
        p["x"], p["ids"], p["w"], p["w13"], p["w2"], fmt=KERNELS[kernel],
        topk_weight_before_fc2=True,  # both kernels weight before quantizing the FC2 input
    )  # fmt: skip
    report = compare_to_oracle(got, ref)
    assert report.ok, f"{kernel} {case.name}: {report}"


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sm100_cutedsl_matches_oracle_ep1(case, kernel):
    require_capability((10, 0), "Blackwell B200/GB200 (sm_100)")
    _check(case, 1, kernel)


@pytest.mark.multirank
@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.name)
def test_sm100_cutedsl_matches_oracle_multirank(case, kernel):
    require_capability((10, 0), "Blackwell B200/GB200 (sm_100)")
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2+ Blackwell GPUs, {n} visible")
    _check(case, min(n, 4), kernel)

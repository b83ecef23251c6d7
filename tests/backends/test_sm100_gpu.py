"""sm100 CuTe DSL kernels against the oracle on a Blackwell GPU (skipped elsewhere, with the
reason). Never run: no Blackwell GPU was available when they were written.

The problems are `sm90_gpu_cases`' (bf16 activations, weights exact in fp8, which the nvfp4,
mxfp8 and mxfp8 x mxfp4 recipes re-quantize with their own block scales, as the oracle
does). The kernels apply the top-k weight before quantizing the FC2 input
(`apply_topk_in_fc1`); the oracle does the same (`sm100_gpu_cases.sm100_oracle`). Their CPU
side runs on CPU with the kernels' portable twins in `test_sm100_gpu_cases.py`.
"""

from __future__ import annotations

import pytest
import torch
from backend_hw import require_capability
from sm90_gpu_cases import CASES
from sm100_gpu_cases import FORMATS, Job, sm100_reports

pytestmark = [pytest.mark.gpu, pytest.mark.sm100]


def _check(job: Job, world_size: int) -> None:
    from moe_ep.registry import get_kernel

    require_capability((10, 0), "Blackwell B200/GB200 (sm_100)")
    ok, why = get_kernel(job.kernel).availability()
    if not ok:
        pytest.skip(f"{job.kernel}: {why}")
    (report,) = sm100_reports([job], world_size, timeout_s=600.0)
    assert report.ok, f"{job}: {report}"


@pytest.mark.parametrize("kernel", sorted(FORMATS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sm100_cutedsl_matches_oracle_ep1(case, kernel):
    _check(Job(case, kernel), 1)


@pytest.mark.parametrize("kernel", sorted(FORMATS))
def test_sm100_cutedsl_padded_slots_after_a_fully_routed_forward(kernel):
    # The drop's top-k reduce sums all k combine cells of a row and nobody writes a padded
    # slot's cell: the layer must clear what the first (fully routed) forward left there.
    _check(Job(CASES[1], kernel, repeat=True), 1)


@pytest.mark.parametrize("kernel", sorted(FORMATS))
def test_sm100_cutedsl_two_layers_of_one_geometry_use_their_own_weights(kernel):
    # Layers of one geometry share one compiled kernel and its buffers (the pool); each
    # must still launch with its own experts.
    _check(Job(CASES[0], kernel, decoy=True), 1)


@pytest.mark.multirank
@pytest.mark.parametrize("kernel", sorted(FORMATS))
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.name)
def test_sm100_cutedsl_matches_oracle_multirank(case, kernel):
    require_capability((10, 0), "Blackwell B200/GB200 (sm_100)")
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2+ Blackwell GPUs, {n} visible")
    _check(Job(case, kernel), min(n, 4))

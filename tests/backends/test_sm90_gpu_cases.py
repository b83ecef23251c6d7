"""The sm90 GPU tests' CPU-side pieces, run on CPU: problems, per-kernel oracle, worker.

`test_sm90_gpu.py` skips here (no Hopper GPU). This module runs its exact code path
(`sm90_gpu_cases.sm90_report`: spawned ranks through `MoEEpLayer`, gathered output against
`sm90_oracle`) with each sm90 kernel replaced by its portable twin (the portable fp8 backend
with the kernel's FC1 grouping), on the same cases shrunk to CPU size, so a slip in the case
building, the oracle call or the worker fails here rather than on the first GPU run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from sm90_gpu_cases import (
    CASES,
    PULL,
    PUSH,
    SM90_RECIPES,
    GpuCase,
    cpu_twin,
    problem_for,
    sm90_oracle,
    sm90_report,
)

from moe_ep.oracle import compare_to_oracle

KERNELS = (PULL, PUSH)


def _small(case: GpuCase) -> GpuCase:
    return replace(case, hidden=256, inter=128, tokens=min(case.tokens, 12))


@pytest.mark.multirank
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_cpu_twin_matches_the_gpu_tests_oracle_ep1(case: GpuCase, kernel: str) -> None:
    report = sm90_report(_small(case), 1, kernel, cpu_twin(kernel), timeout_s=120)
    assert report.ok, f"{kernel} {case.name}: {report}"


@pytest.mark.multirank
def test_cpu_twin_matches_the_gpu_tests_oracle_ep2() -> None:
    case = _small(CASES[1])  # padded slots
    report = sm90_report(case, 2, PULL, cpu_twin(PULL), timeout_s=120)
    assert report.ok, report


@pytest.mark.multirank
def test_the_pull_and_push_oracles_differ_on_the_random_weights() -> None:
    # Random weights make the recipe matter (the fp8-exact weights the sm90 tests used to
    # take hid it): the two kernels' oracles compute different values, and the pull twin
    # sits far closer to its own oracle than to the push kernel's (same problem).
    case = _small(CASES[0])
    pull, push = sm90_oracle(case, 1, PULL), sm90_oracle(case, 1, PUSH)
    assert not torch.equal(pull.exact, push.exact)
    own = sm90_report(case, 1, PULL, cpu_twin(PULL), timeout_s=120)
    other = sm90_report(case, 1, PUSH, cpu_twin(PULL), timeout_s=120)
    assert own.max_ratio * 4 < other.max_ratio, (own, other)
    assert SM90_RECIPES[PULL].fc1_gate_up_interleave == 8
    assert SM90_RECIPES[PUSH].fc1_gate_up_interleave is None


def test_problem_shapes_padding_and_zero_tokens() -> None:
    case = _small(replace(CASES[1], pad_frac=0.5))
    p = problem_for(case, 2, PULL)
    t, e = 2 * case.tokens, 2 * case.experts_per_rank
    assert p["x"].shape == (t, case.hidden) and p["x"].dtype == torch.bfloat16
    assert p["ids"].shape == (t, case.topk) and p["ids"].dtype == torch.int64
    assert p["w13"].shape == (e, 2 * case.inter, case.hidden)
    assert p["w2"].shape == (e, case.hidden, case.inter)
    assert bool((p["ids"] == -1).any()) and int(p["ids"].max()) < e
    empty = problem_for(_small(CASES[4]), 1, PUSH)
    assert empty["x"].shape == (0, 256) and empty["ids"].shape == (0, CASES[4].topk)
    ref = sm90_oracle(_small(CASES[4]), 1, PUSH)
    assert ref.exact.shape == (0, 256)
    assert compare_to_oracle(torch.zeros(0, 256, dtype=torch.bfloat16), ref).ok

"""The sm90 GPU tests' CPU-side pieces, run on CPU: problems, per-kernel oracle, worker.

`test_sm90_gpu.py` skips here (no Hopper GPU). This module runs its exact code path
(`sm90_gpu_cases.sm90_report`: spawned ranks through `MoEEpLayer`, gathered output against
`sm90_oracle`) with each sm90 kernel replaced by its portable twin (`cpu_twin`: the portable
backend with the kernel's recipe), on the same cases shrunk to CPU size, so a slip in the case
building, the oracle call or the worker fails here rather than on the first GPU run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gpu_jobs import Job, ep1_jobs, job_outputs
from sm90_gpu_cases import (
    BF16_PULL,
    CASES,
    MXFP4_PULL,
    NVFP4_PULL,
    PULL,
    PUSH,
    SM90_RECIPES,
    GpuCase,
    backend_for,
    cpu_twin,
    problem_for,
    push_reference,
    sm90_oracle,
    sm90_reference,
    sm90_report,
    sm90_reports,
)

from moe_ep import quant
from moe_ep.backends.portable.configs import Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import compare_to_oracle, oracle_forward

KERNELS = (PULL, PUSH, BF16_PULL, MXFP4_PULL, NVFP4_PULL)


def _small(case: GpuCase) -> GpuCase:
    return replace(case, hidden=256, inter=128, tokens=min(case.tokens, 12))


@pytest.mark.multirank
@pytest.mark.parametrize("kernel", KERNELS)
def test_cpu_twin_matches_the_gpu_tests_oracle_ep1(kernel: str) -> None:
    # The GPU tests' EP1 jobs (every case, a padded forward after a fully routed one, a
    # second layer of one geometry), all in one spawn as there.
    jobs = ep1_jobs(kernel, cpu_twin(kernel), shrink=_small)
    reports = sm90_reports(list(jobs.values()), 1, timeout_s=120)
    bad = {name: r for name, r in zip(jobs, reports, strict=True) if not r.ok}
    assert not bad, f"{kernel}: {bad}"


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


@pytest.mark.multirank
def test_the_portable_fp8_kernel_honours_fc2_act_block() -> None:
    # The pull recipe's 1x64 FC2 input (`fc2_act_block`) goes end to end through the layer
    # (config -> recipe -> requantize): the twin with 64 and the twin with 128 give different
    # outputs, each nearer the oracle of its own block than the other's.
    case = _small(CASES[2])  # one_expert_per_rank: k = 1, a cell is one (token, slot)
    recipes = {b: replace(SM90_RECIPES[PULL], fc2_act_block=b) for b in (64, 128)}
    assert SM90_RECIPES[PULL].fc2_act_block == 64 and SM90_RECIPES[PUSH].fc2_act_block == 128
    twins = {
        b: Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig(**r.oracle_kwargs()) for b, r in recipes.items()
    }
    out64, out128 = job_outputs(
        [Job(case, PULL, twins[64]), Job(case, PULL, twins[128])], 1, backend_for
    )
    exact = {b: sm90_oracle(case, 1, PULL, recipe=r).exact for b, r in recipes.items()}
    assert not torch.equal(out64, out128)
    dist = lambda out, b: float((out.double() - exact[b]).norm())  # noqa: E731
    assert dist(out64, 64) < dist(out64, 128) and dist(out128, 128) < dist(out128, 64)


def test_fc2_act_block_is_refused_outside_its_values() -> None:
    p = problem_for(_small(CASES[0]), 1, PULL)
    args = (p["x"], p["ids"], p["w"], p["w13"], p["w2"])
    for bad in (32, 96, 64.0, True):
        with pytest.raises(MoeEpUsageError, match=f"fc2_act_block must be one of .*{bad!r}"):
            oracle_forward(*args, fmt="fp8", fc2_act_block=bad)  # type: ignore[arg-type]
        with pytest.raises(MoeEpUsageError, match=f"fc2_act_block must be one of .*{bad!r}"):
            Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig(fc2_act_block=bad)  # type: ignore[arg-type]
    with pytest.raises(MoeEpUsageError, match="fc2_act_block=64 applies to fmt='fp8' only"):
        oracle_forward(*args, fmt="mxfp8", fc2_act_block=64)


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


def test_push_reference_follows_the_drop_token_by_token() -> None:
    # The push GPU tests compare with `push_reference` (the drop's bf16 intermediates); here
    # it is restated one (token, slot) at a time from the steps of `sm90_push_a2a_ops.cu`.
    case = GpuCase("tiny", tokens=5, hidden=256, inter=128, experts_per_rank=3, topk=2, seed=9)
    p = problem_for(replace(case, pad_frac=0.3), 1, PUSH)
    w128, a128 = (128, 128), (1, 128)

    def qdq(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
        d, sc = quant.quantize_fp8_blockwise(t.float(), block=block)
        return quant.dequantize_fp8_blockwise(d, sc, block=block)

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    want = torch.zeros(p["x"].shape, dtype=torch.float64)
    for t in range(p["x"].shape[0]):
        xq = qdq(p["x"][t : t + 1], a128)[0].double()
        acc = torch.zeros(p["x"].shape[1], dtype=torch.float32)
        for j in range(case.topk):
            e = int(p["ids"][t, j])
            if e < 0:
                continue
            w13q, w2q = qdq(p["w13"][e : e + 1], w128)[0], qdq(p["w2"][e : e + 1], w128)[0]
            g = bf16((w13q[: case.inter].double() @ xq).float())
            u = bf16((w13q[case.inter :].double() @ xq).float())
            h = bf16(g / (1 + torch.exp(-g)) * u)
            y = bf16((w2q.double() @ qdq(h[None], a128)[0].double()).float())
            acc += bf16(y * p["w"][t, j])
        want[t] = acc.double()
    got = push_reference(p)
    assert bool((p["ids"] == -1).any())
    assert torch.equal(got, want)
    # The bf16 intermediates matter: the push reference is not the oracle's exact value.
    ref = sm90_reference(case, 1, PUSH)
    assert torch.equal(ref.exact, push_reference(problem_for(case, 1, PUSH)))
    assert not torch.equal(ref.exact, sm90_oracle(case, 1, PUSH).exact)
    assert torch.equal(sm90_reference(case, 1, PULL).exact, sm90_oracle(case, 1, PULL).exact)

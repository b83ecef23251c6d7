"""Problems and oracles of the sm90 and sm100 GPU tests (top-level so they pickle); the
spawned workers are `gpu_jobs`'.

The GPU runs have never happened (no GPU lent yet). The CPU-side pieces here (problem
building, the per-kernel oracle recipe, the worker) are exercised on CPU by
`test_sm90_gpu_cases.py` through the portable backend configured with each sm90 kernel's
recipe (its CPU twin), so a slip in them shows up before the first GPU run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

PULL = "sm90_fp8_fp8_bf16_pull_cutedsl"
PUSH = "sm90_fp8_fp8_bf16_push_cuda"
BF16_PULL = "sm90_bf16_bf16_bf16_pull_cutedsl"
MXFP4_PULL = "sm90_fp8_mxfp4_bf16_pull_cutedsl"
NVFP4_PULL = "sm90_fp8_nvfp4_bf16_pull_cutedsl"


@dataclass(frozen=True)
class GpuCase:
    name: str
    tokens: int = 96
    hidden: int = 1024
    inter: int = 512
    experts_per_rank: int = 4
    topk: int = 4
    routing: str = "uniform"  # uniform | skewed (most routes to expert 0)
    pad_frac: float = 0.0
    seed: int = 0


CASES = [
    GpuCase("basic"),
    GpuCase("padded_slots", pad_frac=0.3, seed=1),
    GpuCase("one_expert_per_rank", experts_per_rank=1, topk=1, seed=2),
    GpuCase("skewed", routing="skewed", seed=3),
    GpuCase("zero_tokens", tokens=0, seed=4),
]
"""The problems both GPU test modules run."""


@dataclass(frozen=True)
class Sm90Recipe:
    """How one sm90 kernel quantizes, as `oracle_forward` options (fp8 blockwise, 128x128
    weights, 1x128 FC1 input). The pull kernel: FC1 scale blocks over rows interleaved by 8
    (`fc1_gate_up_interleave`), the FC2 input in 1x64 blocks (its drop's
    `Fp8Fc2ActivationScaleK`, in the kernel and in `mega_reference_fp8`), the top-k weight
    applied to the SwiGLU output before that quantization (`apply_topk_in_fc1`). The push
    kernel: the canonical DeepSeek-V3 recipe (gate-then-up rows, 1x128, weight after FC2).
    The bf16 pull kernel: `fmt="bf16"` (no quantization) with its FC1 output unrounded into
    SwiGLU (fp32 accumulators) and the top-k weight applied before the FC2 input is rounded
    to bf16, as its drop's reference's "deepgemm" graph. The MXFP4 pull kernel:
    `fmt="fp8_mxfp4"` (`mxfp4_hybrid`: one fp32 scale per token, mxfp4 weights clamped to 11
    binades per expert, the FC2 input in 1x64 blocks), the top-k weight before FC2, and its
    config's default gate/up clamp 10.0 (`swiglu_clamp`); its drop ships no reference. The
    NVFP4 pull kernel: the same with `fmt="fp8_nvfp4"` (nvfp4 weights with a per-expert
    decode scale, the e4m3 operand `RN_E4M3(e2m1 * scale / 8)`, `8 * G` per expert); its
    config inherits the clamp 10.0.
    With these the oracle computes with the kernel's own weight values bit for bit, so the
    problems use ordinary random weights; `test_drop_reference_conformance.py` checks the
    pull recipe against the drop's own reference."""

    fc1_gate_up_interleave: int | None
    fc2_act_block: int = 128
    topk_weight_before_fc2: bool = False
    fmt: str = "fp8"
    fc1_output_high_precision: bool = False
    swiglu_clamp: float | None = None

    def oracle_kwargs(self) -> dict[str, Any]:
        """The `oracle_forward` (and portable fp8 config) keywords of this recipe, `fmt`
        aside; each format's own (fp8: FC1 grouping, FC2-input block; bf16: whether the FC1
        output stays unrounded); the clamp where the kernel has one."""
        kwargs: dict[str, Any] = {"apply_routing_weights_before_fc2": self.topk_weight_before_fc2}
        if self.fmt == "fp8":
            kwargs["fc1_gate_up_interleave"] = self.fc1_gate_up_interleave
            kwargs["fc2_act_block"] = self.fc2_act_block
        elif self.fmt == "bf16":
            kwargs["fc1_output_high_precision"] = self.fc1_output_high_precision
        if self.swiglu_clamp is not None:
            kwargs["swiglu_clamp"] = self.swiglu_clamp
        return kwargs


SM90_RECIPES = {
    PULL: Sm90Recipe(fc1_gate_up_interleave=8, fc2_act_block=64, topk_weight_before_fc2=True),
    PUSH: Sm90Recipe(None),
    BF16_PULL: Sm90Recipe(
        None, topk_weight_before_fc2=True, fmt="bf16", fc1_output_high_precision=True
    ),
    MXFP4_PULL: Sm90Recipe(None, topk_weight_before_fc2=True, fmt="fp8_mxfp4", swiglu_clamp=10.0),
    NVFP4_PULL: Sm90Recipe(None, topk_weight_before_fc2=True, fmt="fp8_nvfp4", swiglu_clamp=10.0),
}


def fp8_exact_weights(e: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`[e, n, k]` fp32 weights the fp8 recipes reproduce exactly under any grouping of
    64-row groups into 128-row blocks: e4m3 values times 2**-12, every (64-row, 128-col)
    block holding one element of magnitude 448 (so every block's scale is 2**-12)."""
    q = (torch.randn(e, n, k, generator=gen) * 96).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn).float()
    q[:, ::64, ::128] = 448.0
    return q * 2.0**-12


def make_problem(
    case: GpuCase, world_size: int, *, weights: str = "fp8_exact"
) -> dict[str, torch.Tensor]:
    """Global inputs of `case` on `world_size` ranks: `x [T, H]` bf16, `ids [T, k]` int64
    (-1 = padded slot), `w [T, k]` fp32, `w13 [E, 2I, H]`, `w2 [E, H, I]` fp32.

    `weights`: "fp8_exact" (`fp8_exact_weights`, what the sm100 tests use) or "random"
    (`randn / sqrt(K)`, the sm90 tests: their oracle quantizes with each kernel's recipe).
    """
    if weights not in ("fp8_exact", "random"):
        raise ValueError(f"weights must be 'fp8_exact' or 'random', got {weights!r}")
    gen = torch.Generator().manual_seed(case.seed)
    e = case.experts_per_rank * world_size
    t = case.tokens * world_size
    x = (torch.randn(t, case.hidden, generator=gen)).to(torch.bfloat16)
    if case.routing == "skewed":
        ids = torch.zeros(t, case.topk, dtype=torch.int64)
        ids[:, 1:] = torch.randint(0, e, (t, case.topk - 1), generator=gen)
    else:
        rows = [torch.randperm(e, generator=gen)[: case.topk] for _ in range(t)]
        ids = torch.stack(rows) if rows else torch.empty((0, case.topk), dtype=torch.int64)
    pad = torch.rand(t, case.topk, generator=gen) < case.pad_frac
    ids[pad] = -1
    w = torch.rand(t, case.topk, generator=gen)
    if weights == "random":
        w13 = torch.randn(e, 2 * case.inter, case.hidden, generator=gen) / case.hidden**0.5
        w2 = torch.randn(e, case.hidden, case.inter, generator=gen) / case.inter**0.5
    else:
        w13 = fp8_exact_weights(e, 2 * case.inter, case.hidden, gen)
        w2 = fp8_exact_weights(e, case.hidden, case.inter, gen)
    return {"x": x, "ids": ids, "w": w, "w13": w13, "w2": w2}


def _weights_kind(kernel: str) -> str:
    return "random" if kernel in SM90_RECIPES else "fp8_exact"


def problem_for(case: GpuCase, world_size: int, kernel: str) -> dict[str, torch.Tensor]:
    """`make_problem` with the weights `kernel`'s test uses (random for the sm90 kernels)."""
    return make_problem(case, world_size, weights=_weights_kind(kernel))


def sm90_oracle(
    case: GpuCase, world_size: int, kernel: str, *, recipe: Sm90Recipe | None = None
) -> Any:
    """`oracle_forward` of `case` with `kernel`'s fp8 recipe (`SM90_RECIPES`, or `recipe`)."""
    from moe_ep.oracle import oracle_forward

    p = problem_for(case, world_size, kernel)
    r = SM90_RECIPES[kernel] if recipe is None else recipe
    return oracle_forward(
        p["x"], p["ids"], p["w"], p["w13"], p["w2"], fmt=r.fmt, **r.oracle_kwargs()
    )


def push_reference(p: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[T, H]` float64: the push drop's pipeline step by step on `make_problem`'s inputs.

    Same quantization as `oracle_forward(fmt="fp8")` (activations 1x128, canonical 128x128
    weights), plus the drop's bf16 intermediates the oracle leaves out (read from
    `a2a/sm90_push_a2a_ops.cu` and `push_pipe.PushPipe.run_round`): FC1 `[g; u]` is written
    as bf16 by `moe_gemm`; `silu_mul_quant_grouped` computes `silu(g) * u` in fp32 from those,
    rounds it to bf16, then quantizes 1x128 (fp32 scale amax / 448); FC2 writes bf16 `y`;
    `combine_publish` sends `bf16(y * w)` per slot; `combine_reduce` sums the k partials in
    fp32 in slot order. GEMMs accumulate in float64 here (the kernel: fp32, another order).
    """
    from moe_ep import quant

    def qdq(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
        return quant.dequantize_fp8_blockwise(
            *quant.quantize_fp8_blockwise(t, block=block), block=block
        )

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16).float()

    x, ids, w = p["x"], p["ids"], p["w"]
    xq = qdq(x.float(), (1, 128)).double()
    w13q, w2q = (
        qdq(p["w13"].float(), (128, 128)).double(),
        qdq(p["w2"].float(), (128, 128)).double(),
    )
    inter = int(w2q.shape[-1])
    acc = torch.zeros(x.shape, dtype=torch.float32)
    partials = torch.zeros((*ids.shape, x.shape[1]), dtype=torch.float32)
    for e in range(int(w13q.shape[0])):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = bf16((xq[tok] @ w13q[e].t()).float())
        g, u = gu[:, :inter], gu[:, inter:]
        h = bf16((g / (1.0 + torch.exp(-g))) * u)
        y = bf16((qdq(h, (1, 128)).double() @ w2q[e].t()).float())
        partials[tok, slot] = bf16(y * w[tok, slot, None].float())
    for j in range(int(ids.shape[1])):
        acc += partials[:, j]
    return acc.double()


def sm90_reference(case: GpuCase, world_size: int, kernel: str) -> Any:
    """What a GPU run of sm90 `kernel` is compared with: `sm90_oracle` (its band: terms and
    one-flip allowance), with `exact` replaced by `push_reference` for the push kernel, whose
    bf16 intermediates alone move outputs by up to about one band width from the oracle
    (measured on CPU: max err/band up to 1.17 over 12 seeds of `one_expert_per_rank`, k=1,
    against 0.12 for an emulation of the pull kernel's numerics)."""
    ref = sm90_oracle(case, world_size, kernel)
    if kernel != PUSH:
        return ref
    exact = push_reference(problem_for(case, world_size, kernel))
    return replace(ref, exact=exact, output=exact.to(torch.bfloat16))


def cpu_twin(kernel: str) -> Any:
    """The portable config that quantizes exactly as sm90 `kernel` does (runs on CPU): the
    portable fp8 kernel with the recipe's options, `any_bf16_bf16_bf16_torch` with FC1's
    output kept in fp32 and the top-k weight before FC2 for the bf16 pull kernel, or
    `any_fp8_mxfp4_bf16_torch` / `any_fp8_nvfp4_bf16_torch` for the MXFP4 / NVFP4 pull
    kernels."""
    from moe_ep.backends.portable.configs import (
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig,
        Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig,
        Any_Fp8_Mxfp4_Bf16_Torch_MegaMoeConfig,
        Any_Fp8_Nvfp4_Bf16_Torch_MegaMoeConfig,
    )

    twins = {
        "fp8": Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig,
        "bf16": Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig,
        "fp8_mxfp4": Any_Fp8_Mxfp4_Bf16_Torch_MegaMoeConfig,
        "fp8_nvfp4": Any_Fp8_Nvfp4_Bf16_Torch_MegaMoeConfig,
    }
    recipe = SM90_RECIPES[kernel]
    if recipe.fmt not in twins:
        raise ValueError(f"{kernel}: no portable config computes as it does (see SM90_RECIPES)")
    return twins[recipe.fmt](**recipe.oracle_kwargs())


def backend_for(case: GpuCase, kernel: str) -> Any:
    """What the layer is built with: the sm90 configs with `top_k` (so `warmup()` compiles
    / builds ahead), other kernels by name."""
    from moe_ep_sm90 import (
        Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig,
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
        Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig,
        Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
        Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig,
    )

    if kernel == NVFP4_PULL:
        return Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig(top_k=case.topk)
    if kernel == MXFP4_PULL:
        return Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig(top_k=case.topk)
    if kernel == BF16_PULL:
        return Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig(top_k=case.topk)
    if kernel == PULL:
        return Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(top_k=case.topk)
    if kernel == PUSH:
        return Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig(top_k=case.topk)
    return kernel


def sm90_reports(jobs: list[Any], world_size: int, *, timeout_s: float = 600.0) -> list[Any]:
    """Run `jobs` (`gpu_jobs.Job`) on `world_size` spawned ranks (one process per rank runs
    them all: `gpu_jobs.job_outputs`) and compare each gathered output with `sm90_reference`
    (the kernel itself) or, for a job with a CPU twin backend (which computes as the oracle
    does), with `sm90_oracle`; the `ToleranceReport`s (`.ok` when every cell is inside the
    band) in job order."""
    from gpu_jobs import job_outputs

    from moe_ep.oracle import compare_to_oracle

    outs = job_outputs(jobs, world_size, backend_for, timeout_s=timeout_s)
    return [
        compare_to_oracle(
            got,
            (sm90_oracle if job.backend is not None else sm90_reference)(
                job.case, world_size, job.kernel
            ),
        )
        for job, got in zip(jobs, outs, strict=True)
    ]


def sm90_report(
    case: GpuCase, world_size: int, kernel: str, backend: Any = None, *, timeout_s: float = 600.0
) -> Any:
    """`sm90_reports` of the one job `case` through `kernel` (or `backend`, a CPU twin)."""
    from gpu_jobs import Job

    (report,) = sm90_reports([Job(case, kernel, backend)], world_size, timeout_s=timeout_s)
    return report

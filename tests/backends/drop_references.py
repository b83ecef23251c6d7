"""The drops' own reference forwards on CPU, fed with the GPU wrappers' weights and staging.

Each GPU wrapper whose drop ships a reference that runs on CPU is checked against it on the
GPU tests' problems (`sm90_gpu_cases.CASES`): the wrapper's own weight preparation and input
staging (each kernel's `layout` module), laid out
as the drop's runners hand them to their reference, go through the drop's reference
(`moe_hopper_fp8.mega_reference_fp8`, `moe_hopper_bf16.mega_reference_bf16`,
`moe_mxfp8_glu.mega_reference_mxfp8`,
`moe_nvfp4_swapab.mega_reference`), its top-k reduce is restated (fp32 sum over the slots in
slot order, then bf16: `moe_nvfp4_swapab/topk_reduce.py`), and the result is compared with
the oracle exactly as the GPU test compares the kernel (`compare_to_oracle` against
`sm90_reference` / `sm100_oracle`). A kernel that computes what its drop says must pass its
GPU test; this checks that on CPU.

The drop's code runs from its materialized `src/` through its shim (`import_src_module`);
nothing of it is copied. The CuTe DSL drops share top-level package names, so each kernel's
run is its own process (`conformance_reports` is called through
`backend_testing.run_fresh_python`). The nvfp4 reference and the drop's nvfp4 quantizer call
three CUDA-only helpers; `install_cpu_standins` replaces them in the drop's modules of that
process with the CPU stand-ins below (our code, written from the helpers' docstrings):
- `_rcp_approx_ftz_f32_cuda` (PTX `rcp.approx.ftz.f32`): `torch.reciprocal`, IEEE. The
  block scales it inverts are e4m3 values; whether the GPU's approximate reciprocal is the
  correctly rounded one on all of them is `test_sm100_nvfp4_layout`'s GPU test.
- `_pack_f32_to_fp4` (PTX `cvt.rn.satfinite.e2m1x2.f32`): `pack_e2m1_nearest_even`, the
  nearest e2m1 value by distance (ties to the even code), saturating at 6, sign from the sign
  bit, even element in the low nibble.
- `_BlockScaledGemmReferenceLauncher` (a CuTe DSL block-scaled GEMM): `BlockScaledMatmul`,
  both operands decoded (`moe_ep.quant`'s e2m1 decode, bit-exact with the scalar reference)
  times their expanded e4m3 block scales, multiplied in float64 and rounded to fp32 (exact
  products, exact sum, one rounding).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from sm90_gpu_cases import (
    BF16_PULL,
    CASES,
    PULL,
    SM90_RECIPES,
    GpuCase,
    problem_for,
    sm90_oracle,
)

NVFP4 = "sm100_nvfp4_nvfp4_bf16_cutedsl"
MXFP8 = "sm100_mxfp8_mxfp8_bf16_cutedsl"
KERNELS = (PULL, BF16_PULL, NVFP4, MXFP8)
"""The GPU wrappers whose drop ships a reference that runs on CPU (the push kernel's drop
has none: its host side is FlashInfer's, not in the drop)."""

EP1_RUNS: tuple[tuple[str, int], ...] = tuple((c.name, 1) for c in CASES)
"""(case name, world size) of the GPU tests on one GPU: every case."""
MULTIRANK_RUNS: tuple[tuple[str, int], ...] = tuple((c.name, 2) for c in CASES[:4])
"""... and of their multi-rank tests (the first four cases), at world size 2."""

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack_e2m1_nearest_even(fp32: torch.Tensor) -> torch.Tensor:
    """CPU stand-in for the drop's `_pack_f32_to_fp4` (see the module docstring)."""
    dist = (fp32.abs().clamp(max=6.0).unsqueeze(-1) - _E2M1).abs()
    nearest = dist == dist.amin(-1, keepdim=True)
    even = torch.arange(8) % 2 == 0
    code = (nearest.int() * 2 + even.int()).argmax(-1).to(torch.uint8)  # a tie: the even one
    code |= torch.signbit(fp32).to(torch.uint8) << 3
    pairs = code.view(*code.shape[:-1], code.shape[-1] // 2, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.float4_e2m1fn_x2)


class BlockScaledMatmul:
    """CPU stand-in for the drop's `_BlockScaledGemmReferenceLauncher`:
    `C [M, N] = A [M, K] @ B [K, N]` of block-scaled fp4 operands (K-major, one e4m3 scale
    per `sf_vec_size` along K in raw `[rows, K / vec]` planes), fp32 result."""

    def __init__(self, sf_vec_size: int, mma_tiler_mn: Any = None, cluster_shape_mn: Any = None):
        self.vec = sf_vec_size

    def _rows(self, t: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
        """`[rows, K/2]` packed e2m1 (stride 1 along K) times its scales -> `[rows, K]`."""
        from moe_ep.quant import e2m1_codes_to_float32, unpack_e2m1

        assert t.dtype == torch.float4_e2m1fn_x2 and t.stride(-1) == 1, (t.dtype, t.stride())
        vals = e2m1_codes_to_float32(unpack_e2m1(t.view(torch.uint8)))
        return vals * sf.float().repeat_interleave(self.vec, -1)

    def __call__(self, *, a: Any, sfa: Any, b: Any, sfb: Any, n: int, k: int) -> torch.Tensor:
        af, bf = self._rows(a, sfa), self._rows(b.t(), sfb)  # b: [K/2, N], K-major
        assert af.shape[1] == k and tuple(bf.shape) == (n, k), (af.shape, bf.shape)
        return (af.double() @ bf.double().t()).float()


def install_cpu_standins(drop: Any) -> None:
    """Replace the CUDA-only helpers in this process's modules of the sm100 drop (`drop`:
    its shim package) with the CPU stand-ins; the rest of the drop's code runs as is."""
    rc = drop.import_src_module("moe_nvfp4_swapab.runner_common")
    rc._rcp_approx_ftz_f32_cuda = torch.reciprocal
    rc._pack_f32_to_fp4 = pack_e2m1_nearest_even


def _install_reference_standins(drop: Any) -> Any:
    install_cpu_standins(drop)
    ref = drop.import_src_module("moe_nvfp4_swapab.mega_reference")
    ref._rcp_approx_ftz_f32_cuda = torch.reciprocal
    ref._pack_f32_to_fp4 = pack_e2m1_nearest_even
    ref._BlockScaledGemmReferenceLauncher = BlockScaledMatmul
    ref._check_cuda_inputs = lambda named: None
    return ref


def _rank_inputs(case: GpuCase, world_size: int, kernel: str) -> list[dict[str, torch.Tensor]]:
    """Each rank's share of the GPU test's problem: its tokens and its experts' weights."""
    p = problem_for(case, world_size, kernel)
    n, el = case.tokens, case.experts_per_rank
    return [
        {
            "x": p["x"][r * n : (r + 1) * n],
            "ids": p["ids"][r * n : (r + 1) * n],
            "w": p["w"][r * n : (r + 1) * n],
            "w13": p["w13"][r * el : (r + 1) * el],
            "w2": p["w2"][r * el : (r + 1) * el],
        }
        for r in range(world_size)
    ]


def _k_major(views: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-rank K-major views `[E, K, N]` (stride 1 on K) into `[R, E, K, N]` keeping
    stride 1 on K (a plain `torch.stack` would copy them row-major)."""
    return torch.stack([v.transpose(1, 2) for v in views]).transpose(2, 3)


def sum_topk(combine: torch.Tensor, tokens: int) -> torch.Tensor:
    """The drop's `TopkReduce` on `[R, T, k, H]` bf16 cells before its output rounding (fp32
    accumulator, slots in order), the first `tokens` rows of each rank: `[R * tokens, H]`."""
    acc = torch.zeros(combine.shape[0], combine.shape[1], combine.shape[3])
    for j in range(int(combine.shape[2])):
        acc += combine[:, :, j].float()
    return acc[:, :tokens].reshape(-1, combine.shape[3])


def reduce_topk(combine: torch.Tensor, tokens: int) -> torch.Tensor:
    """`sum_topk` rounded once to bf16: the drop's `TopkReduce` output."""
    return sum_topk(combine, tokens).to(torch.bfloat16)


def _pull_output(case: GpuCase, world_size: int) -> torch.Tensor:
    import moe_ep_drop_sm90_pull as drop

    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.layout import (
        prepare_pull_weights,
        stage_pull_inputs,
    )

    ref = drop.import_src_module("moe_hopper_fp8.mega_reference_fp8")
    ranks = _rank_inputs(case, world_size, PULL)
    t, h = max(case.tokens, 1), case.hidden
    weights = [prepare_pull_weights(r["w13"], r["w2"]) for r in ranks]
    staged = [stage_pull_inputs(r["x"], r["ids"], r["w"], max_tokens=t) for r in ranks]
    combine = ref.compute_megamoe_reference_fp8(
        input_activation=torch.stack([s.activation for s in staged]),
        input_activation_sf=torch.stack([s.activation_scales[:, : h // 128] for s in staged]),
        input_topk_idx=torch.stack([s.topk_ids for s in staged]),
        input_topk_weights=torch.stack([s.topk_weights for s in staged]),
        fc1_weight=_k_major([w.w13 for w in weights]),
        fc1_weight_sf=torch.stack([w.w13_scales for w in weights]),
        fc2_weight=_k_major([w.w2 for w in weights]),
        fc2_weight_sf=torch.stack([w.w2_scales for w in weights]),
        ab_dtype=torch.float8_e4m3fn,
        fp8_scale_mode="blockwise",
        ref_compute_graph="deepgemm",  # the kernel's apply_topk_in_fc1 (pull_args)
    )
    return reduce_topk(combine, case.tokens)


def _bf16_pull_combine(case: GpuCase, world_size: int) -> torch.Tensor:
    """`[R, T, k, H]` bf16 combine cells of the drop's `compute_megamoe_reference_bf16`."""
    import moe_ep_drop_sm90_pull as drop

    from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.layout import (
        prepare_bf16_pull_weights,
        stage_bf16_pull_inputs,
    )

    ref = drop.import_src_module("moe_hopper_bf16.mega_reference_bf16")
    ranks = _rank_inputs(case, world_size, BF16_PULL)
    t = max(case.tokens, 1)
    weights = [prepare_bf16_pull_weights(r["w13"], r["w2"]) for r in ranks]
    staged = [stage_bf16_pull_inputs(r["x"], r["ids"], r["w"], max_tokens=t) for r in ranks]
    return ref.compute_megamoe_reference_bf16(
        input_activation=torch.stack([s.activation for s in staged]),
        input_topk_idx=torch.stack([s.topk_ids for s in staged]),
        input_topk_weights=torch.stack([s.topk_weights for s in staged]),
        fc1_weight=_k_major([w.w13 for w in weights]),
        fc2_weight=_k_major([w.w2 for w in weights]),
        ref_compute_graph="deepgemm",  # the kernel's apply_topk_in_fc1 (common.pull_args)
    )


def _bf16_pull_output(case: GpuCase, world_size: int) -> torch.Tensor:
    return reduce_topk(_bf16_pull_combine(case, world_size), case.tokens)


def _plain_scales(swizzled: torch.Tensor, rows: int, cols: int, to_blocked: Any) -> torch.Tensor:
    """`[E, flat]` 128x4-swizzled planes of the wrapper -> `[E, rows, cols]` plain ones, checked
    to be exactly what the drop's `to_blocked` makes of them (the runners' layout)."""
    from moe_ep.quant import unswizzle_128x4

    plain = unswizzle_128x4(swizzled.view(torch.uint8), rows, cols)
    for e in range(int(plain.shape[0])):
        assert torch.equal(to_blocked(plain[e]).reshape(-1), swizzled[e].view(torch.uint8))
    return plain


def _nvfp4_output(case: GpuCase, world_size: int) -> torch.Tensor:
    import moe_ep_drop_sm100_cutedsl as drop

    from moe_ep_sm100 import Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig as Config
    from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.layout import (
        prepare_nvfp4_weights,
        stage_nvfp4_inputs,
    )

    ref = _install_reference_standins(drop)
    rc = drop.import_src_module("moe_nvfp4_swapab.runner_common")
    comm = drop.import_src_module("src.token_comm")
    cfg = Config(top_k=case.topk)  # the GPU test's config: default global scales
    ranks = _rank_inputs(case, world_size, NVFP4)
    t, h, i = max(case.tokens, 1), case.hidden, case.inter
    weights = [
        prepare_nvfp4_weights(
            r["w13"],
            r["w2"],
            input_norm_const=cfg.input_norm_const,
            hidden_norm_const=cfg.hidden_norm_const,
        )
        for r in ranks
    ]
    staged = [
        stage_nvfp4_inputs(
            r["x"], r["ids"], r["w"], max_tokens=t, input_norm_const=cfg.input_norm_const
        )
        for r in ranks
    ]
    fp4, e4m3 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn
    out = ref.compute_megamoe_reference(
        input_activation=torch.stack([s.activation.view(fp4) for s in staged]),
        input_activation_sf=torch.stack([s.activation_scales[:, : h // 16] for s in staged]),
        input_topk_idx=torch.stack([s.topk_ids for s in staged]),
        input_topk_weights=torch.stack([s.topk_weights for s in staged]),
        fc1_weight=_k_major([w.w13.view(fp4) for w in weights]),
        fc1_weight_sf=torch.stack(
            [_plain_scales(w.w13_scales, 2 * i, h // 16, rc.to_blocked) for w in weights]
        ).view(e4m3),
        fc2_weight=_k_major([w.w2.view(fp4) for w in weights]),
        fc2_weight_sf=torch.stack(
            [_plain_scales(w.w2_scales, h, i // 16, rc.to_blocked) for w in weights]
        ).view(e4m3),
        fc1_alpha=torch.stack([w.fc1_alpha for w in weights]),
        fc2_alpha=torch.stack([w.fc2_alpha for w in weights]),
        fc1_norm_const=torch.stack([w.fc1_norm_const for w in weights]),
        ref_compute_graph="deepgemm",  # the kernel's apply_topk_in_fc1 (nvfp4_args)
        combine_format=comm.CombineFormat.parse("bf16"),
    )
    # The reference's own reduce (deepgemm graph: fp32 sum of the k cells, one bf16 rounding)
    # is the top-k reduce restated above; check that, then take its rows.
    assert torch.equal(
        reduce_topk(out.combine_output, case.tokens),
        out.combine_reduced_output[:, : case.tokens].reshape(-1, h),
    )
    return reduce_topk(out.combine_output, case.tokens)


def _mxfp8_output(case: GpuCase, world_size: int) -> torch.Tensor:
    import moe_ep_drop_sm100_cutedsl as drop

    from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.layout import (
        prepare_mxfp8_weights,
        stage_mxfp8_inputs,
    )

    ref = drop.import_src_module("moe_mxfp8_glu.mega_reference_mxfp8")
    rc = drop.import_src_module("moe_nvfp4_swapab.runner_common")
    ranks = _rank_inputs(case, world_size, MXFP8)
    t, h, i = max(case.tokens, 1), case.hidden, case.inter
    weights = [prepare_mxfp8_weights(r["w13"], r["w2"]) for r in ranks]
    staged = [stage_mxfp8_inputs(r["x"], r["ids"], r["w"], max_tokens=t) for r in ranks]
    e8m0 = torch.float8_e8m0fnu
    combine = ref.compute_megamoe_reference_mxfp8(
        input_activation=torch.stack([s.activation for s in staged]),
        input_activation_sf=torch.stack([s.activation_scales[:, : h // 32] for s in staged]).view(
            e8m0
        ),
        input_topk_idx=torch.stack([s.topk_ids for s in staged]),
        input_topk_weights=torch.stack([s.topk_weights for s in staged]),
        fc1_weight=_k_major([w.w13 for w in weights]),
        fc1_weight_sf=torch.stack(
            [_plain_scales(w.w13_scales, 2 * i, h // 32, rc.to_blocked) for w in weights]
        ).view(e8m0),
        fc2_weight=_k_major([w.w2 for w in weights]),
        fc2_weight_sf=torch.stack(
            [_plain_scales(w.w2_scales, h, i // 32, rc.to_blocked) for w in weights]
        ).view(e8m0),
        ab_dtype=torch.float8_e4m3fn,
        apply_topk_in_fc1=True,  # the kernel's (mxfp8_args)
    )
    return reduce_topk(combine, case.tokens)


_OUTPUTS = {
    PULL: _pull_output,
    BF16_PULL: _bf16_pull_output,
    NVFP4: _nvfp4_output,
    MXFP8: _mxfp8_output,
}


def drop_reference_output(kernel: str, case: GpuCase, world_size: int) -> torch.Tensor:
    """`[world_size * tokens, H]` bf16: what `kernel`'s drop says the layer outputs on the
    GPU test's problem `case`, fed with the wrapper's weights and staging."""
    return _OUTPUTS[kernel](case, world_size)


def _oracle(kernel: str, case: GpuCase, world_size: int, pull_recipe: dict[str, Any]) -> Any:
    """What the GPU test compares `kernel` with (`sm90_reference` is `sm90_oracle` for the
    pull kernels); `pull_recipe` overrides fields of its `SM90_RECIPES` entry."""
    if kernel in SM90_RECIPES:
        recipe = replace(SM90_RECIPES[kernel], **pull_recipe)
        return sm90_oracle(case, world_size, kernel, recipe=recipe)
    from sm100_gpu_cases import sm100_oracle

    return sm100_oracle(case, world_size, kernel)


def conformance_reports(
    kernel: str,
    runs: tuple[tuple[str, int], ...],
    *,
    planted_pull_recipes: dict[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """For each (case name, world size) of `runs`: the drop reference's output compared with
    the GPU test's oracle; `{"<case>/ep<ws>": {"ok", "max_ratio", "violations", "report"}}`
    (JSON-ready). `planted_pull_recipes` (the sm90 pull kernels only) adds, per run, a
    comparison with the oracle of a wrong recipe, `"<case>/ep<ws>/<label>"` for
    `{label: SM90_RECIPES[kernel] fields to change}`. Call it in a process where `kernel`'s
    drop may be the active one."""
    from moe_ep.oracle import compare_to_oracle

    by_name = {c.name: c for c in CASES}
    recipes = {"": {}, **{f"/{k}": v for k, v in (planted_pull_recipes or {}).items()}}
    out = {}
    for name, ws in runs:
        case = by_name[name]
        got = drop_reference_output(kernel, case, ws)
        for label, fields in recipes.items():
            report = compare_to_oracle(got, _oracle(kernel, case, ws, fields))
            out[f"{name}/ep{ws}{label}"] = _json_report(report)
    return out


def _json_report(report: Any) -> dict[str, Any]:
    return {
        "ok": report.ok,
        "max_ratio": report.max_ratio,
        "violations": report.violations,
        "report": str(report),
    }


def bf16_twin_reports(
    runs: tuple[tuple[str, int], ...], *, planted: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """The bf16 pull kernel's CPU twin (`sm90_gpu_cases.cpu_twin`, through the GPU tests'
    spawned layers) against the drop's own `compute_megamoe_reference_bf16`: for each
    (case name, world size) of `runs`, the twin's output compared (`compare_to_oracle`) with
    the drop reference's values (its top-k reduce before the output rounding, `sum_topk`)
    in the band of the kernel's oracle; `"<case>/ep<ws>"`, and `"<case>/ep<ws>/<label>"` for
    a planted twin `{label: twin config fields to change}`. JSON-ready, as
    `conformance_reports`; call it in a process where the pull drop may be the active one."""
    from gpu_jobs import Job, job_outputs
    from sm90_gpu_cases import backend_for, cpu_twin

    from moe_ep.oracle import compare_to_oracle

    twin = cpu_twin(BF16_PULL)
    twins = {"": twin, **{f"/{k}": replace(twin, **v) for k, v in (planted or {}).items()}}
    by_name = {c.name: c for c in CASES}
    out = {}
    for ws in sorted({ws for _, ws in runs}):
        cases = [by_name[name] for name, w in runs if w == ws]
        jobs = [Job(c, BF16_PULL, t) for c in cases for t in twins.values()]
        outputs = iter(job_outputs(jobs, ws, backend_for, timeout_s=600))
        for case in cases:
            exact = sum_topk(_bf16_pull_combine(case, ws), case.tokens).double()
            ref = replace(sm90_oracle(case, ws, BF16_PULL), exact=exact, output=exact.bfloat16())
            for label in twins:
                report = compare_to_oracle(next(outputs), ref)
                out[f"{case.name}/ep{ws}{label}"] = _json_report(report)
    return out

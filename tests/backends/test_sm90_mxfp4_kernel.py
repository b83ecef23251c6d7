"""`sm90_fp8_mxfp4_bf16_pull_cutedsl`'s kernel class on CPU: its refusals before any
collective, availability reasons, weight preparation (bf16 weights and pre-quantized packs,
back to the logical layout), the gate/up clamp, and its never-run launch path through
core's CuTe DSL base with the recording fakes of `cute_fakes`."""

from __future__ import annotations

import pytest
import torch
from backend_testing import (
    FakeRuntime,
    assert_layer_refuses_before_joining,
    assert_padded_cells_zeroed,
    assert_pull_availability_reasons,
    routed_tensors,
)
from cute_fakes import FakeSymBufferHost, install_fake_modules, recording_kernel_class

import moe_ep_sm90.common.pull_drop as pull_drop
import moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.kernel as mx
from moe_ep import quant
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm90.common.tile_fold import (
    unfold_codes,
    unfold_offsets,
)
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.args import tensor_specs
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig as Config,
)
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.layout import (
    mxfp4_pull_legs,
    prepare_mxfp4_hybrid_weights,
)
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.upstream import Mxfp4KernelApi

H, I, E, T, K, WORLD, RANK = 256, 128, 4, 8, 2, 2, 1  # noqa: E741 - glossary names
KERNEL = mx.Sm90Fp8Mxfp4Bf16PullCutedslKernel


def _problem(**over):
    p = dict(
        hidden_size=1024, intermediate_size=512, top_k=8, num_experts=16, world_size=2,
        max_tokens_per_rank=128,
    )  # fmt: skip
    return {**p, **over}


def _fleet():
    return FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H)


def _weights(seed=0, dtype=torch.bfloat16, i=I, h=H):
    g = torch.Generator().manual_seed(seed)
    el = E // WORLD
    return MoEWeightPack(
        w13=(torch.randn(el, 2 * i, h, generator=g) / 16).to(dtype),
        w2=(torch.randn(el, h, i, generator=g) / 11).to(dtype),
    )


def _pack(w: MoEWeightPack) -> MoEWeightPack:
    (p13, s13), (p2, s2) = quant.quantize_mxfp4(w.w13), quant.quantize_mxfp4(w.w2)
    return MoEWeightPack(
        w13=p13, w2=p2, w13_scale=s13.view(torch.uint8), w2_scale=s2.view(torch.uint8)
    )


# -- the gate/up clamp: upstream's default, honoured ----------------------------------------
def test_gate_up_clamp_defaults_to_upstreams_10_and_reaches_the_kernel(gpu):
    assert Config().gate_up_clamp == 10.0
    for clamp in (10.0, 3.5, None):
        layer = KERNEL(
            config=Config(top_k=K, gate_up_clamp=clamp), fleet=_fleet(),
            runtime=FakeRuntime(rank=RANK, world_size=WORLD), weights=_weights(),
        )  # fmt: skip
        layer.warmup()
        assert gpu.kernels[-1].kwargs["gate_up_clamp"] == clamp
        layer.destroy()


@pytest.mark.parametrize("clamp", [-1.0, 0.0, float("inf"), float("nan")])
def test_a_bad_clamp_is_refused(clamp):
    with pytest.raises(MoeEpUsageError, match=r"gate_up_clamp must be finite and > 0"):
        Config(gate_up_clamp=clamp)


# -- the kernel's constraints, refused before any collective ------------------------------
@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"hidden_size": 1152 + 64}, r"hidden_size must be a multiple of 128.*got 1216"),
        ({"intermediate_size": 448}, r"intermediate_size must be a multiple of 128.*got 448"),
        ({"top_k": 33, "num_experts": 64}, r"top_k must be <= 32.*got 33"),
        ({"top_k": 17}, r"top_k \(17\) must be <= num_experts \(16\)"),
    ],
)
def test_geometry_the_kernel_cannot_run_is_refused(over, match):
    with pytest.raises(MoeEpUsageError, match=match):
        Config().check_problem(**_problem(**over))
    Config(top_k=32).check_problem(**_problem(top_k=32, num_experts=64))


def test_weights_the_kernel_cannot_take_are_refused():
    fleet = _fleet()
    with pytest.raises(MoeEpUsageError, match=r"multiples of 128, got H=256, I=64"):
        KERNEL.validate_weights(_weights(i=64), fleet, WORLD, Config())
    with pytest.raises(MoeEpUsageError, match=r"top_k \(5\) must be <= num_experts \(4\)"):
        KERNEL.validate_weights(_weights(), fleet, WORLD, Config(top_k=5))
    fp8 = MoEWeightPack(
        w13=_weights().w13.to(torch.float8_e4m3fn), w2=_weights().w2.to(torch.float8_e4m3fn),
        w13_scale=torch.ones(E // WORLD, 2 * I // 128, H // 128),
        w2_scale=torch.ones(E // WORLD, H // 128, I // 128),
    )  # fmt: skip
    with pytest.raises(MoeEpUsageError, match=r"w13 dtype must be one of \(uint8\)"):
        KERNEL.validate_weights(fp8, fleet, WORLD, Config())
    pack = _pack(_weights())
    bad = MoeEpUsageError
    nan = MoEWeightPack(w13=pack.w13, w2=pack.w2, w13_scale=pack.w13_scale.clone().fill_(255),
                        w2_scale=pack.w2_scale)  # fmt: skip
    with pytest.raises(bad, match=r"w13_scale holds E8M0 byte 255"):
        KERNEL.validate_weights(nan, fleet, WORLD, Config())
    short = MoEWeightPack(w13=pack.w13, w2=pack.w2, w13_scale=pack.w13_scale[..., :-1],
                          w2_scale=pack.w2_scale)  # fmt: skip
    with pytest.raises(bad, match=r"w13_scale"):
        KERNEL.validate_weights(short, fleet, WORLD, Config())
    inf = _weights()
    inf.w2[0, 0, 0] = float("inf")
    with pytest.raises(bad, match=r"w2 has non-finite values"):
        KERNEL.validate_weights(inf, fleet, WORLD, Config())
    for ok in (_weights(), pack, _weights(dtype=torch.float32)):
        shape = KERNEL.validate_weights(ok, fleet, WORLD, Config())
        assert (shape.hidden_size, shape.intermediate_size) == (H, I)


def test_the_layer_refuses_what_the_kernel_cannot_run_before_joining_the_group(monkeypatch):
    wide = FleetParams(num_experts=64, max_tokens_per_rank=T, hidden_size=H)
    el = 64 // WORLD
    many = MoEWeightPack(w13=torch.zeros(el, 2 * I, H), w2=torch.zeros(el, H, I))
    cases = [
        (_fleet(), _weights(i=64), Config(), r"multiples of 128, got H=256, I=64"),
        (_fleet(), _weights(), Config(top_k=5), r"top_k \(5\) must be <= num_experts \(4\)"),
        (wide, many, Config(top_k=33), r"top_k must be <= 32.*got 33"),
    ]
    assert_layer_refuses_before_joining(KERNEL, monkeypatch, cases, world_size=WORLD, rank=RANK)


# -- availability ----------------------------------------------------------------------
def test_availability_names_what_this_machine_lacks(monkeypatch):
    assert_pull_availability_reasons(KERNEL, monkeypatch)


def test_upstream_has_no_deprecated_alias_for_this_name():
    assert KERNEL.deprecated_aliases == ()


# -- weight preparation ------------------------------------------------------------------
def test_a_pack_and_its_bf16_weights_prepare_alike_and_unfold_to_the_logical_legs():
    w = _weights(3)
    from_bf16 = mxfp4_pull_legs(w.w13, w.w2)
    p = _pack(w)
    from_pack = mxfp4_pull_legs(p.w13, p.w2, p.w13_scale, p.w2_scale)
    logical = prepare_mxfp4_hybrid_weights(w.w13, w.w2)
    for a, b, leg, (n, k) in zip(from_bf16, from_pack, logical, ((2 * I, H), (H, I)), strict=True):
        assert a.weight.shape == (E // WORLD, k // 2, n) and a.weight.stride(1) == 1
        assert a.weight.dtype == torch.uint8
        assert a.offsets.shape == (E // WORLD, n // 64, k // 128, 16, 16)
        for x, y in ((a.weight, b.weight), (a.offsets, b.offsets), (a.scale, b.scale)):
            assert torch.equal(x, y)
        assert torch.equal(unfold_codes(a.weight.transpose(1, 2)), leg.codes)
        assert torch.equal(unfold_offsets(a.offsets), leg.offsets)
        assert torch.equal(a.scale, leg.residual64) and a.scale.dtype == torch.float32
        for t in (a.weight, a.offsets, a.scale):
            assert t.data_ptr() % 16 == 0


# -- the never-run launch path, on fakes -------------------------------------------------
@pytest.fixture
def gpu(monkeypatch):
    gpu = install_fake_modules(monkeypatch, world_size=WORLD, rank=RANK)
    kernel_cls = recording_kernel_class(gpu, pull_drop.COMBINE_REGION)
    api = Mxfp4KernelApi(
        swap_ab_kernel=kernel_cls, sym_buffer_host=FakeSymBufferHost, sf_padding_block=128,
        e8m0_sf_vec_size=32,
    )  # fmt: skip
    monkeypatch.setattr(mx, "load_mxfp4_api", lambda: api)
    monkeypatch.setattr(KERNEL, "availability", classmethod(lambda c: (True, "")))
    return gpu


def _layer(runtime, seed=0, weights=None):
    return KERNEL(
        config=Config(top_k=K), fleet=_fleet(), runtime=runtime,
        weights=weights if weights is not None else _weights(seed),
    )  # fmt: skip


def _forward(kernel, n=3):
    t = routed_tensors(n, K, H, E)
    out = torch.zeros(n, H, dtype=torch.bfloat16)
    return kernel.compute_staged(staged=kernel.stage_inputs(tensors=t, output=out))


def test_layers_of_one_geometry_share_a_compile_and_launch_with_their_own_weights(gpu):
    rt = FakeRuntime(rank=RANK, world_size=WORLD)
    a, b = _layer(rt, seed=1), _layer(rt, weights=_pack(_weights(2)))
    a.warmup()
    b.warmup()
    assert len(gpu.compiles) == 1
    ((_, args),) = gpu.compiles
    kw = gpu.kernels[0].kwargs
    assert kw["fp8_scale_mode"] == "mxfp4_hybrid" and kw["combine_format"] == "bf16"
    assert kw["fc2_in_kernel_topk_reduce"] is False and kw["generate_c"] is False
    assert "ab_dtype" not in kw and kw["static_expert_shape"] == (E // WORLD, 2 * I, H)
    assert kw["token_padding_block"] == 64 and kw["mma_tiler_mnk"] == (128, 64, 128)
    assert args["fc1_c"] is None
    _forward(a)
    _forward(b)
    la, lb = gpu.compiled.launches
    for layer, launch in ((a, la), (b, lb)):
        fc1, fc2 = layer.prepared
        for name, t in (
            ("fc1_weight", fc1.weight), ("fc1_weight_sf", fc1.offsets),
            ("fc1_weight_dequant_scale", fc1.scale), ("fc2_weight", fc2.weight),
            ("fc2_weight_sf", fc2.offsets), ("fc2_weight_dequant_scale", fc2.scale),
        ):  # fmt: skip
            assert launch[name].tensor is t, name
    # each weight argument has its ArgSpec's shape, dtype and stride 1 on the leading dim
    specs = {spec.name: spec for spec in tensor_specs(a.geometry)}
    for name in a._weight_tensors():
        t, spec = la[name].tensor, specs[name]
        assert tuple(t.shape) == spec.shape and str(t.dtype) == f"torch.{spec.dtype}", name
        assert t.stride(spec.leading_dim) == 1 and la[name].leading_dim == spec.leading_dim
    assert la["activation"].tensor is lb["activation"].tensor
    assert la["activation"].tensor.dtype == torch.float8_e4m3fn
    entry = a._entry()
    sf = entry.staging["activation_sf"]
    assert sf.shape == (T, 4) and sf.dtype == torch.float32
    for name in ("fc1_activation_dequant_scale", "fc2_activation_dequant_scale"):
        assert torch.equal(la[name].tensor, torch.ones(1))
    # the staged scale row is the token's one hybrid scale, four times (the last stage: b's)
    _, s = quant.quantize_fp8_per_token_hybrid(routed_tensors(3, K, H, E).hidden_states)
    assert torch.equal(sf[:3], s.expand(3, 4)) and not sf[3:].any()
    # peers pull activation, its scale row and the routing, and write into the output
    sym_bytes = sorted(t.numel() for t in entry.symmetric[1:])
    assert sym_bytes == sorted([T * H, T * 4 * 4, T * K * 8, T * K * 4, T * H * 2])
    a.destroy()
    b.destroy()


def test_padded_slots_combine_cells_are_zeroed_before_each_launch(gpu):
    layer = _layer(FakeRuntime(rank=RANK, world_size=WORLD))
    assert_padded_cells_zeroed(gpu, layer, _forward)


# -- the GPU tests' oracle and CPU twin --------------------------------------------------------
def test_the_gpu_tests_build_this_config_and_its_twin_computes_its_recipe():
    from sm90_gpu_cases import CASES, MXFP4_PULL, SM90_RECIPES, backend_for, cpu_twin

    from moe_ep.backends.portable.configs import Any_Fp8_Mxfp4_Bf16_Torch_MegaMoeConfig

    assert backend_for(CASES[0], MXFP4_PULL) == Config(top_k=CASES[0].topk)
    twin = cpu_twin(MXFP4_PULL)
    assert isinstance(twin, Any_Fp8_Mxfp4_Bf16_Torch_MegaMoeConfig)
    # the kernel's clamp (upstream's default) and its top-k weight before the FC2 input
    assert twin.swiglu_clamp == Config().gate_up_clamp == 10.0
    assert twin.apply_routing_weights_before_fc2 is True
    assert SM90_RECIPES[MXFP4_PULL].fmt == "fp8_mxfp4"


@pytest.mark.multirank
def test_the_gpu_tests_band_fails_a_twin_with_another_recipe():
    # The comparison the GPU tests make (`sm90_reports` against the fp8_mxfp4 oracle) passes
    # the twin and fails planted faults: the fp8 blockwise recipe (the fp8 pull kernel's),
    # DeepGEMM's fp8 x mxfp4 recipe (1x128 UE8M0 activations, no exponent clamp), a clamp
    # that engages. (The top-k weight after FC2 instead of before it stays inside the band:
    # same value, another rounding of the FC2 input; measured max err/band 0.07.)
    from dataclasses import replace

    from gpu_jobs import Job
    from sm90_gpu_cases import CASES, MXFP4_PULL, PULL, cpu_twin, sm90_reports

    from moe_ep.backends.portable.configs import Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig

    case = replace(CASES[2], hidden=256, inter=128, tokens=12)  # k = 1
    twin = cpu_twin(MXFP4_PULL)
    faults = [
        cpu_twin(PULL),
        Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig(),
        replace(twin, swiglu_clamp=0.5),
    ]
    jobs = [Job(case, MXFP4_PULL, b) for b in (twin, *faults)]
    good, *bad = sm90_reports(jobs, 1, timeout_s=120)
    assert good.ok, good
    assert [r.ok for r in bad] == [False] * len(faults), bad

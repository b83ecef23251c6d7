"""`sm90_fp8_nvfp4_bf16_pull_cutedsl`'s kernel class on CPU: its refusals before any
collective, availability reasons (both drops), the host-side quantization against the portable
twin `any_fp8_nvfp4_bf16_torch` bit for bit, weight preparation (bf16 weights and
pre-quantized packs, back to the logical layout), and its never-run launch path through core's
CuTe DSL base with the recording fakes of `cute_fakes` (the NVFP4 knobs, planes and staging)."""

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
import moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.kernel as nv
from moe_ep import quant
from moe_ep.backends.portable.recipes import Fp8Nvfp4Recipe
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm90.common.tile_fold import unfold_codes
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl import upstream
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig as Config,
)
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.layout import (
    kperm_index,
    nvfp4_pull_legs,
    prepare_nvfp4_weights,
    unprepare_nvfp4_leg,
)

H, I, E, T, K, WORLD, RANK = 256, 128, 4, 8, 2, 2, 1  # noqa: E741 - glossary names
KERNEL = nv.Sm90Fp8Nvfp4Bf16PullCutedslKernel


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
    """The twin's rule applied by hand: an nvfp4 pack with its decode scales G."""
    out = {}
    for name in ("w13", "w2"):
        x = getattr(w, name)
        g = quant.nvfp4_decode_scale(x, dim=(-2, -1))
        out[name], out[f"{name}_scale"] = quant.quantize_nvfp4_decode_scaled(x, decode_scale=g)
        out[f"{name}_global_scale"] = g.reshape(-1)
    return MoEWeightPack(**out)


# -- the host quantization: the twin's, bit for bit ------------------------------------------
@pytest.mark.parametrize("kperm", [0, 32, 64])
@pytest.mark.parametrize("source", ["bf16", "fp32", "pack"])
def test_host_quantization_is_the_twins_bit_for_bit(kperm, source):
    w = _weights(7, dtype=torch.float32 if source == "fp32" else torch.bfloat16)
    given = _pack(w) if source == "pack" else w
    legs = prepare_nvfp4_weights(given, kperm=kperm)
    twin = Fp8Nvfp4Recipe().prepare(given)
    for leg, fc1, want, alpha in (
        (legs[0], True, twin.w13t, twin.alpha13),
        (legs[1], False, twin.w2t, twin.alpha2),
    ):
        codes, scales, _ = unprepare_nvfp4_leg(leg, kperm=kperm, fc1=fc1)
        operand = quant.nvfp4_e4m3_operand(codes, scales.view(torch.float8_e4m3fn))
        assert torch.equal(operand.float(), want.transpose(1, 2))  # the kernel's e4m3 operand
        assert alpha is not None and torch.equal(leg.decode_x8, alpha)  # 8 * G


def test_a_pack_and_its_bf16_weights_prepare_alike_and_unfold_to_the_logical_legs():
    w = _weights(3)
    from_bf16 = nvfp4_pull_legs(w, kperm=64)
    from_pack = nvfp4_pull_legs(_pack(w), kperm=64)
    logical = prepare_nvfp4_weights(w, kperm=64)
    for a, b, leg, (n, k) in zip(from_bf16, from_pack, logical, ((2 * I, H), (H, I)), strict=True):
        assert a.weight.shape == (E // WORLD, k // 2, n) and a.weight.stride(1) == 1
        assert a.scales.shape == (E // WORLD, n // 64, k // 128, 32, 16)
        for x, y in ((a.weight, b.weight), (a.scales, b.scales), (a.decode_x8, b.decode_x8)):
            assert torch.equal(x, y)
        assert torch.equal(unfold_codes(a.weight.transpose(1, 2)), leg.payload)
        assert torch.equal(a.scales, leg.scales) and torch.equal(a.decode_x8, leg.decode_x8)
        for t in (a.weight, a.scales, a.decode_x8):
            assert t.data_ptr() % 16 == 0


# -- refusals before any collective ------------------------------------------------------------
def test_weights_the_kernel_cannot_take_are_refused():
    fleet = _fleet()
    with pytest.raises(MoeEpUsageError, match=r"multiples of 128, got H=256, I=64"):
        KERNEL.validate_weights(_weights(i=64), fleet, WORLD, Config())
    with pytest.raises(MoeEpUsageError, match=r"top_k \(5\) must be <= num_experts \(4\)"):
        KERNEL.validate_weights(_weights(), fleet, WORLD, Config(top_k=5))
    pack = _pack(_weights())

    def with_(**over):
        return MoEWeightPack(**{**pack.__dict__, **over})

    cases = [
        (with_(w13_scale=pack.w13_scale.view(torch.uint8).clone().fill_(127)), r"w13_scale holds"),
        (with_(w13_scale=pack.w13_scale.view(torch.uint8).clone().fill_(200)), r"> 126"),
        (with_(w2_scale=pack.w2_scale[..., :-1]), r"w2_scale"),
        (with_(w13_global_scale=-pack.w13_global_scale), r"w13_global_scale .* positive"),
        (with_(w13_global_scale=pack.w13_global_scale.double()), r"w13_global_scale"),
    ]
    for bad, match in cases:
        with pytest.raises(MoeEpUsageError, match=match):
            KERNEL.validate_weights(bad, fleet, WORLD, Config())
    inf = _weights()
    inf.w2[0, 0, 0] = float("inf")
    with pytest.raises(MoeEpUsageError, match=r"w2 has non-finite values"):
        KERNEL.validate_weights(inf, fleet, WORLD, Config())
    for ok in (_weights(), pack, _weights(dtype=torch.float32)):
        shape = KERNEL.validate_weights(ok, fleet, WORLD, Config())
        assert (shape.hidden_size, shape.intermediate_size) == (H, I)


def test_the_layer_refuses_what_the_kernel_cannot_run_before_joining_the_group(monkeypatch):
    cases = [
        (_fleet(), _weights(i=64), Config(), r"multiples of 128, got H=256, I=64"),
        (_fleet(), _weights(), Config(top_k=5), r"top_k \(5\) must be <= num_experts \(4\)"),
    ]
    assert_layer_refuses_before_joining(KERNEL, monkeypatch, cases, world_size=WORLD, rank=RANK)


# -- availability ------------------------------------------------------------------------------
def test_availability_names_what_is_missing(monkeypatch):
    assert_pull_availability_reasons(KERNEL, monkeypatch)


def test_availability_names_either_unmaterialized_drop(monkeypatch):
    monkeypatch.setattr(type(pull_drop.PULL_DROP), "reason", lambda self: f"{self.dist} is empty")
    ok, why = KERNEL.availability()
    assert not ok
    assert "moe-ep-drop-sm90-pull-cutedsl is empty" in why
    assert "moe-ep-drop-sm90-pull-nvfp4 is empty" in why
    assert upstream.NVFP4_DROP.dist == "moe-ep-drop-sm90-pull-nvfp4"


def test_upstream_has_no_deprecated_alias_for_this_name():
    assert KERNEL.deprecated_aliases == ()


# -- the never-run launch path, on fakes -------------------------------------------------------
class _Layout:
    def __init__(self, kperm: int = 64) -> None:
        self.kperm = kperm


@pytest.fixture
def gpu(monkeypatch):
    gpu = install_fake_modules(monkeypatch, world_size=WORLD, rank=RANK)
    kernel_cls = recording_kernel_class(gpu, pull_drop.COMBINE_REGION)
    api = upstream.Nvfp4KernelApi(
        swap_ab_kernel=kernel_cls, sym_buffer_host=FakeSymBufferHost, sf_padding_block=128,
        e8m0_sf_vec_size=32, conversion_layout=_Layout,
    )  # fmt: skip
    monkeypatch.setattr(nv, "load_nvfp4_api", lambda: api)
    monkeypatch.setattr(KERNEL, "availability", classmethod(lambda c: (True, "")))
    return gpu


def _forward(kernel, n=3):
    t = routed_tensors(n, K, H, E)
    out = torch.zeros(n, H, dtype=torch.bfloat16)
    return kernel.compute_staged(staged=kernel.stage_inputs(tensors=t, output=out))


@pytest.mark.parametrize("kperm", [0, 32])
def test_layers_of_one_geometry_share_a_compile_and_launch_with_their_own_weights(gpu, kperm):
    rt = FakeRuntime(rank=RANK, world_size=WORLD)
    cfg = Config(top_k=K, nvfp4_kperm=kperm)
    a = KERNEL(config=cfg, fleet=_fleet(), runtime=rt, weights=_weights(1))
    b = KERNEL(config=cfg, fleet=_fleet(), runtime=rt, weights=_pack(_weights(2)))
    a.warmup()
    b.warmup()
    assert len(gpu.compiles) == 1
    kw = gpu.kernels[0].kwargs
    assert kw["nvfp4_conversion"].kperm == kperm and kw["nvfp4_fc1_k256_overlap"] is False
    assert kw["fp8_scale_mode"] == "mxfp4_hybrid" and kw["combine_format"] == "bf16"
    _forward(a)
    _forward(b)
    la, lb = gpu.compiled.launches
    for layer, launch in ((a, la), (b, lb)):
        fc1, fc2 = layer.prepared
        for name, t in (
            ("fc1_weight", fc1.weight), ("fc1_weight_sf", fc1.scales),
            ("fc1_weight_dequant_scale", fc1.decode_x8), ("fc2_weight", fc2.weight),
            ("fc2_weight_sf", fc2.scales), ("fc2_weight_dequant_scale", fc2.decode_x8),
        ):  # fmt: skip
            assert launch[name].tensor is t, name
    assert la["fc1_weight_sf"].tensor.shape == (E // WORLD, 2 * I // 64, H // 128, 32, 16)
    for name in ("fc1_activation_dequant_scale", "fc2_activation_dequant_scale"):
        assert torch.equal(la[name].tensor, torch.ones(1))
    # the staged rows: the token's e4m3 values with H in kperm order (the last stage: b's)
    x = routed_tensors(3, K, H, E).hidden_states
    data, s = quant.quantize_fp8_per_token_hybrid(x)
    entry = a._entry()
    staged = entry.staging["activation"][:3].view(torch.uint8)
    assert torch.equal(staged, data.view(torch.uint8)[:, kperm_index(H, kperm)])
    assert torch.equal(entry.staging["activation_sf"][:3], s.expand(3, 4))
    a.destroy()
    b.destroy()


def test_padded_slots_combine_cells_are_zeroed_before_each_launch(gpu):
    layer = KERNEL(
        config=Config(top_k=K), fleet=_fleet(), runtime=FakeRuntime(rank=RANK, world_size=WORLD),
        weights=_weights(),
    )  # fmt: skip
    assert_padded_cells_zeroed(gpu, layer, _forward)


def test_a_k256_overlap_config_compiles_its_own_kernel(gpu):
    rt = FakeRuntime(rank=RANK, world_size=WORLD)
    plain = KERNEL(config=Config(top_k=K), fleet=_fleet(), runtime=rt, weights=_weights())
    tile = (128, 64, 256)
    cfg = Config(top_k=K, mma_tiler_mnk=tile, nvfp4_fc1_k256_overlap=True)
    overlap = KERNEL(config=cfg, fleet=_fleet(), runtime=rt, weights=_weights())
    plain.warmup()
    overlap.warmup()
    assert len(gpu.compiles) == 2
    assert [k.kwargs["nvfp4_fc1_k256_overlap"] for k in gpu.kernels] == [False, True]
    assert gpu.kernels[1].kwargs["mma_tiler_mnk"] == tile
    plain.destroy()
    overlap.destroy()

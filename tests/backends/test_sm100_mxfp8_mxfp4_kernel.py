"""`Sm100Mxfp8Mxfp4Bf16CutedslKernel` on CPU with the GPU-only pieces faked (`_compile`,
`_launch`): the staging buffers are built by core's `storage_tensor` from the kernel's real
`tensor_specs`, so what is tested is this wrapper's logic: padded token rows, int32 route ids,
masked routes, staging into the kernel's dtypes, output copy-out, prepared weights against
the argument specs, local refusals before anything is compiled, and availability."""

from __future__ import annotations

import pytest
import torch
from backend_testing import (
    FakeRuntime,
    assert_weights_match_their_specs,
    fake_cutedsl_gpu,
    make_kernel,
    routed_tensors,
)

import moe_ep_sm100.common.cutedsl as launch
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig as Config,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.kernel import (
    Sm100Mxfp8Mxfp4Bf16CutedslKernel as Kernel,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.layout import stage_mxfp8_inputs

H, I, E, T = 256, 128, 4, 5  # noqa: E741 - the glossary names (I = intermediate)


@pytest.fixture
def faked(monkeypatch):
    return fake_cutedsl_gpu(monkeypatch, Kernel, launch.POOL)


def _kernel(config: Config, hidden: int = H) -> Kernel:
    return make_kernel(Kernel, config, num_experts=E, intermediate=I, hidden=hidden, max_tokens=T)


def test_staging_pads_rows_and_masks_routes_then_copies_out(faked) -> None:
    compiled, launches, _ = faked
    k = _kernel(Config(top_k=2))
    t = routed_tensors(3, 2, H, E)  # row 0, slot 1 is masked (-1)
    out = torch.zeros(3, H, dtype=torch.bfloat16)
    staged = k.stage_inputs(tensors=t, output=out)
    buf = compiled[0].staging
    rows = 6  # T=5 tokens x top_k=2 routes padded to a multiple of 4 routes
    want = stage_mxfp8_inputs(t.hidden_states, t.topk_ids, t.topk_weights, max_tokens=rows)
    assert buf["activation"].dtype == torch.float8_e4m3fn
    assert tuple(buf["activation"].shape) == (rows, H)
    assert buf["activation_sf"].dtype == torch.float8_e8m0fnu
    assert tuple(buf["activation_sf"].shape) == (rows, 16)
    u8 = lambda x: x.view(torch.uint8)  # noqa: E731
    assert torch.equal(u8(buf["activation"]), u8(want.activation))
    assert torch.equal(u8(buf["activation_sf"]), u8(want.activation_scales))
    assert buf["topk_idx"].dtype == torch.int32 and torch.equal(buf["topk_idx"], want.topk_ids)
    assert buf["topk_idx"][0, 1] == -1 and buf["topk_weights"][0, 1] == 0
    assert int(buf["topk_idx"][3:].max()) == -1
    assert torch.equal(buf["topk_weights"], want.topk_weights)
    got = k.compute_staged(staged=staged)
    assert got is out and len(launches) == 1
    assert torch.equal(out[:, 7], torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
    k.destroy()


def test_prepared_weights_match_the_compiled_argument_specs(faked) -> None:
    k = _kernel(Config(top_k=2))
    assert_weights_match_their_specs(k)
    k.destroy()


def test_layers_of_one_geometry_share_one_compile(faked) -> None:
    compiled, _, freed = faked
    a, b = _kernel(Config(top_k=2)), _kernel(Config(top_k=2))
    a.warmup()
    b.warmup()
    assert len(compiled) == 1
    a.destroy()
    assert freed == []
    b.destroy()
    assert freed == compiled


@pytest.mark.parametrize(
    ("hidden", "inter", "match"),
    [(192, 128, "hidden_size must be a multiple of 128"), (256, 64, "intermediate_size")],
)
def test_bad_geometry_is_refused_before_anything_runs(faked, hidden, inter, match) -> None:
    compiled, _, _ = faked
    runtime = FakeRuntime()
    with pytest.raises(MoeEpUsageError, match=match):
        Kernel(
            config=Config(top_k=2),
            fleet=FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=hidden),
            runtime=runtime,
            weights=MoEWeightPack(
                w13=torch.zeros(E, 2 * inter, hidden), w2=torch.zeros(E, hidden, inter)
            ),
        )
    assert compiled == [] and runtime.barriers == 0


def test_prequantized_pack_is_accepted_and_equals_the_bf16_path(faked) -> None:
    from moe_ep.quant import quantize_mxfp4

    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    (q13, s13), (q2, s2) = (quantize_mxfp4(w, normal_scales=True) for w in (w13, w2))
    fleet = FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H)
    packed = Kernel(
        config=Config(top_k=2), fleet=fleet, runtime=FakeRuntime(),
        weights=MoEWeightPack(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2),
    )  # fmt: skip
    plain = Kernel(
        config=Config(top_k=2), fleet=fleet, runtime=FakeRuntime(),
        weights=MoEWeightPack(w13=w13, w2=w2),
    )  # fmt: skip
    for name in ("w13", "w13_scales", "w2", "w2_scales"):
        assert torch.equal(getattr(packed.prepared, name), getattr(plain.prepared, name)), name
    packed.destroy()
    plain.destroy()


def test_too_many_routes_are_refused_at_the_first_inputs(faked) -> None:
    k = _kernel(Config(top_k=2))
    t = routed_tensors(3, 3, H, E)
    with pytest.raises(MoeEpUsageError, match="top_k=2"):
        k.stage_inputs(tensors=t, output=torch.empty(3, H, dtype=torch.bfloat16))
    k.destroy()


def test_availability_names_what_is_missing_here() -> None:
    ok, why = Kernel.availability()
    assert not ok
    if not torch.cuda.is_available():
        assert "no CUDA device visible" in why
    assert Kernel.kernel_name == "sm100_mxfp8_mxfp4_bf16_cutedsl"

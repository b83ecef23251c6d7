"""Lifecycle of the sm100 CuTe DSL kernel wrappers on CPU, GPU-only pieces faked.

`_compile` (cutlass, NVSHMEM) and `_launch` are replaced by fakes; the staging buffers are
built by the real `storage_tensor` from the real `tensor_specs`, so what is tested is our
own logic: pooling per (kernel, config, geometry, device), ref-counted release, staging
into the kernel's dtypes, output copy-out, errors, and that the prepared weights match the
argument specs the compiled kernel was built for. The real launch has never run on a GPU.
"""

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
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm100 import (
    Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.kernel import (
    Sm100Mxfp8Mxfp8Bf16CutedslKernel,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.layout import stage_mxfp8_inputs
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.kernel import (
    Sm100Nvfp4Nvfp4Bf16CutedslKernel,
)
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.layout import stage_nvfp4_inputs

H, I, E, T = 256, 128, 4, 8  # noqa: E741 - the glossary names (I = intermediate)

KINDS = {
    "nvfp4": (Sm100Nvfp4Nvfp4Bf16CutedslKernel, Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig),
    "mxfp8": (Sm100Mxfp8Mxfp8Bf16CutedslKernel, Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig),
}


@pytest.fixture(params=sorted(KINDS))
def kind(request, monkeypatch):
    cls, cfg = KINDS[request.param]
    compiled, launches, freed = fake_cutedsl_gpu(monkeypatch, cls, launch.POOL)
    return request.param, cls, cfg, compiled, freed, launches


def _kernel(cls, config, hidden=H, runtime=None):
    return make_kernel(
        cls,
        config,
        num_experts=E,
        intermediate=I,
        hidden=hidden,
        max_tokens=T,
        runtime=runtime,
    )


def _tensors(n=3, k=2, hidden=H):
    return routed_tensors(n, k, hidden, E)


def test_layers_share_one_compile_per_geometry_and_free_on_last_destroy(kind):
    _, cls, cfg, compiled, freed, _ = kind
    a, b = _kernel(cls, cfg(top_k=2)), _kernel(cls, cfg(top_k=2))
    other = _kernel(cls, cfg(top_k=2), hidden=2 * H)
    for k in (a, b, other):
        k.warmup()
    assert len(compiled) == 2
    a.destroy()
    assert freed == []
    b.destroy()
    assert freed == [compiled[0]]
    b.destroy()
    assert freed == [compiled[0]]
    other.destroy()
    assert freed == compiled
    with pytest.raises(MoeEpUsageError, match="destroyed"):
        a.stage_inputs(tensors=_tensors(), output=torch.empty(3, H, dtype=torch.bfloat16))


def test_nvfp4_and_mxfp8_of_one_geometry_do_not_share(kind, monkeypatch):
    name, cls, cfg, compiled, _, _ = kind
    other_name = "mxfp8" if name == "nvfp4" else "nvfp4"
    other_cls, other_cfg = KINDS[other_name]
    monkeypatch.setattr(other_cls, "availability", classmethod(lambda c: (True, "")))
    monkeypatch.setattr(other_cls, "_compile", cls._compile)
    a, b = _kernel(cls, cfg(top_k=2)), _kernel(other_cls, other_cfg(top_k=2))
    a.warmup()
    b.warmup()
    assert len(compiled) == 2 and compiled[0] is not compiled[1]
    a.destroy()
    b.destroy()


def test_staging_in_kernel_dtypes_and_output_copy_out(kind):
    name, cls, cfg, compiled, _, launches = kind
    k = _kernel(cls, cfg(top_k=2))
    t = _tensors(n=3)
    out = torch.zeros(3, H, dtype=torch.bfloat16)
    staged = k.stage_inputs(tensors=t, output=out)
    buf = compiled[0].staging
    if name == "nvfp4":
        want = stage_nvfp4_inputs(t.hidden_states, t.topk_ids, t.topk_weights, max_tokens=T)
        assert buf["activation"].dtype == torch.float4_e2m1fn_x2
        assert buf["activation_sf"].dtype == torch.float8_e4m3fn
        assert tuple(buf["activation"].shape) == (T, H // 2)
    else:
        want = stage_mxfp8_inputs(t.hidden_states, t.topk_ids, t.topk_weights, max_tokens=T)
        assert buf["activation"].dtype == torch.float8_e4m3fn
        assert buf["activation_sf"].dtype == torch.float8_e8m0fnu
        assert tuple(buf["activation"].shape) == (T, H)
    u8 = lambda x: x.view(torch.uint8)  # noqa: E731
    assert torch.equal(u8(buf["activation"]), u8(want.activation))
    assert torch.equal(u8(buf["activation_sf"]), u8(want.activation_scales))
    assert torch.equal(buf["topk_idx"], want.topk_ids)
    assert buf["topk_idx"].dtype == torch.int64 and int(buf["topk_idx"][3:].max()) == -1
    assert torch.equal(buf["topk_weights"], want.topk_weights)
    got = k.compute_staged(staged=staged)
    assert got is out and len(launches) == 1
    assert torch.equal(out[:, 5], torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
    k.destroy()


def test_prepared_weights_match_the_compiled_argument_specs(kind):
    """Every weight argument, reinterpreted as the launch does, has the spec's storage shape
    and stride 1 on the spec's leading dim (what `mark_layout_dynamic` is told)."""
    _, cls, cfg, _, _, _ = kind
    k = _kernel(cls, cfg(top_k=2))
    assert_weights_match_their_specs(k)
    k.destroy()


def test_top_k_from_config_or_first_inputs(kind):
    _, cls, cfg, compiled, _, _ = kind
    lazy = _kernel(cls, cfg())
    lazy.warmup()
    assert compiled == [] and lazy.runtime.barriers == 1
    lazy.stage_inputs(tensors=_tensors(k=2), output=torch.empty(3, H, dtype=torch.bfloat16))
    assert len(compiled) == 1
    with pytest.raises(MoeEpUsageError, match="top_k=2"):
        lazy.stage_inputs(tensors=_tensors(k=3), output=torch.empty(3, H, dtype=torch.bfloat16))
    lazy.destroy()


def test_bad_pack_and_unavailable(kind, monkeypatch):
    _, cls, cfg, _, _, _ = kind
    # I is read from w2, so the mismatch is named on w13
    with pytest.raises(MoeEpUsageError, match=r"w13 must be \[E_local, 2I, H\] .*I = 192 from w2"):
        cls(
            config=cfg(top_k=2),
            fleet=FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H),
            runtime=FakeRuntime(),
            weights=MoEWeightPack(w13=torch.zeros(E, 2 * I, H), w2=torch.zeros(E, H, I + 64)),
        )
    monkeypatch.setattr(cls, "availability", classmethod(lambda c: (False, "no CUDA device")))
    k = _kernel(cls, cfg(top_k=2))
    with pytest.raises(MoeEpUnavailableError, match="no CUDA device"):
        k.warmup()
    k.destroy()

"""Lifecycle and availability of the DeepGEMM mega-MoE wrapper on CPU, `deep_gemm` faked.

A recording module stands in for `deep_gemm` (in `sys.modules`): its
`get_symm_buffer_for_mega_moe` returns a buffer with the input views the real one has
(`x` e4m3, `x_sf` int32, `topk_idx` int64, `topk_weights` fp32, rows aligned up) and its
`fp8_fp4_mega_moe` records its keyword arguments. What is tested is our own code: pooling,
ref-counted destroy, what is staged into the views, and that the calls receive the prepared
tensors in the documented layouts. The real `deep_gemm` has never been called.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from backend_testing import FakeRuntime, make_kernel, routed_tensors

import moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.kernel as dg
import moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.upstream as api
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError
from moe_ep_sm100 import Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig as Config
from moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.layout import stage_deepgemm_inputs

H, I, E, T = 512, 512, 4, 8  # noqa: E741 - the glossary names (I = intermediate)
ALIGN = 16  # the fake aligns max tokens up, as deep_gemm does


@dataclass
class GroupRuntime(FakeRuntime):
    group: object = field(default_factory=object)


class FakeSymmBuffer:
    def __init__(self, log: list, x_dtype: torch.dtype = torch.float8_e4m3fn, **kw: Any) -> None:
        self.kw, self.log = kw, log
        rows = -(-kw["num_max_tokens_per_rank"] // ALIGN) * ALIGN
        self.num_max_tokens_per_rank = rows
        self.x = torch.zeros(rows, kw["hidden"], dtype=x_dtype)
        self.x_sf = torch.zeros(rows, kw["hidden"] // 128, dtype=torch.int32)
        self.topk_idx = torch.full((rows, kw["num_topk"]), 7, dtype=torch.int64)
        self.topk_weights = torch.zeros(rows, kw["num_topk"])
        self.destroyed = 0

    def destroy(self) -> None:
        self.destroyed += 1
        self.log.append(("destroy", self))


def fake_deep_gemm(log: list, *, x_dtype: torch.dtype = torch.float8_e4m3fn) -> types.ModuleType:
    mod = types.ModuleType("deep_gemm")
    mod.__version__ = "9.9.9-fake"  # type: ignore[attr-defined]

    def get_symm_buffer_for_mega_moe(
        group, num_experts, num_max_tokens_per_rank, num_topk, hidden, intermediate_hidden
    ):
        buf = FakeSymmBuffer(
            log,
            x_dtype,
            group=group,
            num_experts=num_experts,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            num_topk=num_topk,
            hidden=hidden,
            intermediate_hidden=intermediate_hidden,
        )
        log.append(("alloc", buf))
        return buf

    def fp8_fp4_mega_moe(
        y,
        l1_weights,
        l2_weights,
        sym_buffer,
        cumulative_local_expert_recv_stats=None,
        recipe=(1, 1, 32),
        activation="swiglu",
        activation_clamp=None,
        fast_math=True,
    ):
        log.append(("launch", dict(locals())))
        # Row r of the output: 1 + the first staged id of token r (proves it read the buffer).
        y.copy_((sym_buffer.topk_idx[: y.shape[0], :1] + 1).float().expand_as(y))

    mod.get_symm_buffer_for_mega_moe = get_symm_buffer_for_mega_moe  # type: ignore[attr-defined]
    mod.fp8_fp4_mega_moe = fp8_fp4_mega_moe  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def log(monkeypatch):
    events: list = []
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm(events))
    cls = dg.Sm100Fp8Fp4Bf16DeepgemmKernel
    monkeypatch.setattr(cls, "availability", classmethod(lambda c: (True, "")))
    yield events
    leftover = len(dg.POOL)
    dg.POOL._slots.clear()  # keep one failing test from leaking into the next
    assert leftover == 0, "a test left a pooled buffer behind"


def _kernel(config, hidden=H, runtime=None):
    return make_kernel(
        dg.Sm100Fp8Fp4Bf16DeepgemmKernel,
        config,
        num_experts=E,
        intermediate=I,
        hidden=hidden,
        max_tokens=T,
        runtime=runtime or GroupRuntime(),
    )


def _of(log, kind):
    return [x for k, x in log if k == kind]


def test_layers_share_one_buffer_per_geometry_and_free_on_last_destroy(log):
    rt = GroupRuntime()
    a, b = _kernel(Config(top_k=2), runtime=rt), _kernel(Config(top_k=2), runtime=rt)
    other = _kernel(Config(top_k=4), runtime=rt)
    for k in (a, b, other):
        k.warmup()
    bufs = _of(log, "alloc")
    assert len(bufs) == 2
    assert bufs[0].kw == dict(
        group=rt.group,
        num_experts=E,
        num_max_tokens_per_rank=T,
        num_topk=2,
        hidden=H,
        intermediate_hidden=I,
    )
    assert bufs[1].kw["num_topk"] == 4
    a.destroy()
    assert _of(log, "destroy") == []
    b.destroy()
    b.destroy()  # idempotent
    assert _of(log, "destroy") == [bufs[0]]
    other.destroy()
    assert _of(log, "destroy") == bufs and bufs[1].destroyed == 1
    with pytest.raises(MoeEpUsageError, match="destroyed"):
        a.stage_inputs(tensors=routed_tensors(3, 2, H, E), output=torch.empty(3, H))


def test_staging_fills_the_buffer_views_and_launch_gets_the_prepared_layouts(log):
    k = _kernel(Config(top_k=2, gate_up_clamp=7.0))
    t = routed_tensors(3, 2, H, E)
    out = torch.zeros(3, H, dtype=torch.bfloat16)
    staged = k.stage_inputs(tensors=t, output=out)
    (buf,) = _of(log, "alloc")
    want = stage_deepgemm_inputs(t.hidden_states, t.topk_ids, t.topk_weights, max_tokens=T)
    assert torch.equal(buf.x[:T].view(torch.uint8), want.activation.view(torch.uint8))
    assert torch.equal(buf.x_sf[:T], want.activation_scales)
    assert torch.equal(buf.topk_idx[:T], want.topk_ids)
    assert torch.equal(buf.topk_weights[:T], want.topk_weights)
    assert int(buf.topk_idx[T:].max()) == -1  # rows past T: padding, filled once at allocation
    assert k.compute_staged(staged=staged) is out
    (call,) = _of(log, "launch")
    p = k.prepared
    assert call["y"] is out and call["sym_buffer"] is buf
    assert call["l1_weights"][0] is p.w13 and call["l1_weights"][1] is p.w13_scales
    assert call["l2_weights"][0] is p.w2 and call["l2_weights"][1] is p.w2_scales
    assert call["recipe"] == (1, 1, 32) and call["activation"] == "swiglu"
    assert call["activation_clamp"] == 7.0 and call["fast_math"] is False
    assert call["cumulative_local_expert_recv_stats"] is None
    # The documented layouts (what deep_gemm's host checks ask for).
    w13, s13 = call["l1_weights"]
    w2, s2 = call["l2_weights"]
    assert w13.dtype == w2.dtype == torch.int8 and w13.is_contiguous() and w2.is_contiguous()
    assert w13.shape == (E, 2 * I, H // 2) and w2.shape == (E, H, I // 2)
    assert s13.dtype == s2.dtype == torch.int32
    assert s13.shape == (E, 2 * I, H // 128) and s13.stride() == (2 * I * H // 128, 1, 2 * I)
    assert s2.shape == (E, H, I // 128) and s2.stride() == (H * I // 128, 1, H)
    assert out[:, 0].tolist() == [float(i) + 1 for i in want.topk_ids[:3, 0].tolist()]
    k.destroy()


def test_prepared_weights_are_the_layout_modules_and_prequantized_packs_work(log):
    from moe_ep.quant import quantize_mxfp4
    from moe_ep.types import FleetParams, MoEWeightPack
    from moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.layout import prepare_deepgemm_weights

    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    fleet = FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H)
    k = dg.Sm100Fp8Fp4Bf16DeepgemmKernel(
        config=Config(),
        fleet=fleet,
        runtime=GroupRuntime(),
        weights=MoEWeightPack(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2),
    )
    assert k.geometry.intermediate_size == I
    want = prepare_deepgemm_weights(w13, w2)
    for name in ("w13", "w13_scales", "w2", "w2_scales"):
        assert torch.equal(getattr(k.prepared, name), getattr(want, name)), name
    k.destroy()


def test_non_contiguous_output_is_written_through_a_temporary(log):
    k = _kernel(Config(top_k=2))
    t = routed_tensors(3, 2, H, E)
    base = torch.zeros(H, 3, dtype=torch.bfloat16)
    out = base.t()  # [3, H], not contiguous
    k.compute_staged(staged=k.stage_inputs(tensors=t, output=out))
    (call,) = _of(log, "launch")
    assert call["y"] is not out and call["y"].is_contiguous()
    assert torch.equal(out, call["y"])
    k.destroy()


def test_zero_tokens_still_launch(log):
    from moe_ep.types import MoEEpTensors

    k = _kernel(Config(top_k=2))
    t = MoEEpTensors(
        hidden_states=torch.zeros(0, H, dtype=torch.bfloat16),
        topk_ids=torch.zeros(0, 2, dtype=torch.int64),
        topk_weights=torch.zeros(0, 2),
    )
    out = torch.zeros(0, H, dtype=torch.bfloat16)
    k.compute_staged(staged=k.stage_inputs(tensors=t, output=out))
    (call,) = _of(log, "launch")
    assert call["y"].shape == (0, H)
    k.destroy()


def test_top_k_from_the_first_inputs_then_fixed(log):
    k = _kernel(Config())
    k.warmup()
    assert _of(log, "alloc") == []
    k.stage_inputs(tensors=routed_tensors(2, 3, H, E), output=torch.zeros(2, H))
    assert _of(log, "alloc")[0].kw["num_topk"] == 3
    with pytest.raises(MoeEpUsageError, match="built for top_k=3"):
        k.stage_inputs(tensors=routed_tensors(2, 2, H, E), output=torch.zeros(2, H))
    k.destroy()


def test_buffer_views_other_than_documented_are_refused_and_freed(monkeypatch):
    events: list = []
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm(events, x_dtype=torch.bfloat16))
    cls = dg.Sm100Fp8Fp4Bf16DeepgemmKernel
    monkeypatch.setattr(cls, "availability", classmethod(lambda c: (True, "")))
    k = _kernel(Config(top_k=2))
    with pytest.raises(MoeEpUnavailableError, match=r"SymmBuffer\.x is torch.bfloat16 \[16, 512\]"):
        k.warmup()
    assert len(_of(events, "destroy")) == 1 and len(dg.POOL) == 0
    k.destroy()


def test_shape_rules_before_any_allocation(log):
    from moe_ep.types import FleetParams, MoEWeightPack

    with pytest.raises(MoeEpUsageError, match="hidden_size must be a multiple of 512"):
        _kernel(Config(top_k=2), hidden=256)
    w13, w2 = torch.zeros(E, 2 * 256, H), torch.zeros(E, H, 256)
    fleet = FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H)
    with pytest.raises(MoeEpUsageError, match="intermediate_size must be a multiple of 512"):
        dg.Sm100Fp8Fp4Bf16DeepgemmKernel.validate_weights(
            MoEWeightPack(w13=w13, w2=w2), fleet, 1, Config()
        )
    with pytest.raises(MoeEpUsageError, match="= 4 / 2 = 2 experts"):
        dg.Sm100Fp8Fp4Bf16DeepgemmKernel.validate_weights(
            MoEWeightPack(w13=w13, w2=w2), fleet, 2, Config()
        )
    assert _of(log, "alloc") == []


# -- availability --------------------------------------------------------------------------


def test_availability_here_names_the_package_and_the_gpu():
    ok, why = dg.Sm100Fp8Fp4Bf16DeepgemmKernel.availability()
    assert not ok
    if "deep_gemm" not in sys.modules:
        assert "python package 'deep_gemm'" in why and "deepseek-ai/DeepGEMM" in why
    if not torch.cuda.is_available():
        assert "no CUDA device visible" in why


@pytest.fixture
def blackwell(monkeypatch):
    """Pretend the package is installed, a capability 10.0 GPU is visible and torch is new
    enough (whatever torch this run has)."""
    monkeypatch.setattr(api, "missing_packages", lambda mods: [])
    monkeypatch.setattr(api, "cuda_capability_reason", lambda cap, label: "")
    monkeypatch.setattr(torch, "__version__", "2.9.0+cu130")


def test_availability_with_the_api_written_against(blackwell, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm([]))
    assert api.deepgemm_availability() == (True, "")


def test_availability_names_a_missing_function_and_the_version(blackwell, monkeypatch):
    mod = fake_deep_gemm([])
    del mod.fp8_fp4_mega_moe
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    ok, why = api.deepgemm_availability()
    assert not ok
    assert "deep_gemm 9.9.9-fake does not have the mega-MoE API" in why
    assert "no function fp8_fp4_mega_moe" in why


def test_availability_names_missing_parameters(blackwell, monkeypatch):
    mod = fake_deep_gemm([])
    mod.fp8_fp4_mega_moe = lambda y, l1_weights, l2_weights, buffer, recipe=None: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deep_gemm", mod)
    ok, why = api.deepgemm_availability()
    assert not ok
    assert "fp8_fp4_mega_moe lacks parameter(s) sym_buffer, activation, activation_clamp" in why


def test_availability_reports_a_failing_import(blackwell, monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import raises ImportError
    ok, why = api.deepgemm_availability()
    assert not ok and why.startswith("import deep_gemm failed: ModuleNotFoundError")


def test_availability_reports_an_old_torch(blackwell, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.8.1+cu128")
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm([]))
    ok, why = api.deepgemm_availability()
    assert not ok and "torch 2.8.1+cu128 is too old" in why and ">= 2.9" in why

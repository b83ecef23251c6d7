"""Pre-quantized fp8 weight packs for the sm90 kernels (`moe_ep_sm90.common.fp8_packs`, the
kernels' `layout.*_from_pack`), on CPU.

A pack that fits a kernel's recipe must give exactly the tensors the kernel prepares from the
bf16 weights the pack was quantized from (`prepare_pull_weights` / `prepare_push_weights`,
compared byte for byte, strides included); every other pack is refused before any collective
with a `MoeEpUsageError` naming the mismatch. The packs are built here with `moe_ep.quant`
directly (`quantize_fp8_blockwise`, `interleave_gate_up`), not with the module under test.
"""

from __future__ import annotations

import pytest
import torch
from backend_testing import FakeRuntime
from layout_references import dequantize_pull_weights

from moe_ep import quant
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm90 import (
    Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
    Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig,
)
from moe_ep_sm90.common.fp8_packs import check_prequantized_pack
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.kernel import (
    Sm90Fp8Fp8Bf16PullCutedslKernel as Pull,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.layout import (
    prepare_pull_weights,
    quantize_pull_pack,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.kernel import (
    Sm90Fp8Fp8Bf16PushCudaKernel as Push,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.layout import prepare_push_weights

E, H, I = 2, 256, 128  # noqa: E741 - the glossary names (I = intermediate)
W = (128, 128)
FLEET = FleetParams(num_experts=E, max_tokens_per_rank=8, hidden_size=H)


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g).to(torch.bfloat16)
    w2 = torch.randn(E, H, I, generator=g).to(torch.bfloat16)
    return w13, w2


def _canonical_pack(w13: torch.Tensor, w2: torch.Tensor) -> MoEWeightPack:
    q13, s13 = quant.quantize_fp8_blockwise(w13, block=W)
    q2, s2 = quant.quantize_fp8_blockwise(w2, block=W)
    return MoEWeightPack(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)


def _paired_pack(w13: torch.Tensor, w2: torch.Tensor, b: int) -> MoEWeightPack:
    """FC1 quantized over rows interleaved by b, payload stored back in gate-then-up order."""
    q13i, s13 = quant.quantize_fp8_blockwise(quant.interleave_gate_up(w13, b), block=W)
    q2, s2 = quant.quantize_fp8_blockwise(w2, block=W)
    return MoEWeightPack(w13=quant.deinterleave_gate_up(q13i, b), w2=q2, w13_scale=s13, w2_scale=s2)


def _prepared(cls: type, config: object, pack: MoEWeightPack) -> object:
    cls.validate_weights(pack, FLEET, 1, config)  # type: ignore[attr-defined]
    kernel = cls(config=config, fleet=FLEET, runtime=FakeRuntime(), weights=pack)
    return kernel.prepared  # type: ignore[attr-defined]


def _assert_same(got: object, want: object) -> None:
    for name in ("w13", "w13_scales", "w2", "w2_scales"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride(), name
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), name


@pytest.mark.parametrize("b", [8, 16, 32])
def test_pull_pack_quantized_over_interleaved_rows_equals_the_recipe(b: int) -> None:
    w13, w2 = _weights()
    cfg = Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(prequantized_fc1_gate_up_interleave=b)
    _assert_same(_prepared(Pull, cfg, _paired_pack(w13, w2, b)), prepare_pull_weights(w13, w2))


def test_quantize_pull_pack_is_the_paired_pack() -> None:
    w13, w2 = _weights(5)
    got, want = quantize_pull_pack(w13, w2), _paired_pack(w13, w2, 8)
    for name in ("w13", "w2"):
        assert torch.equal(
            getattr(got, name).view(torch.uint8), getattr(want, name).view(torch.uint8)
        )
        assert torch.equal(getattr(got, f"{name}_scale"), getattr(want, f"{name}_scale"))
    cfg = Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(prequantized_fc1_gate_up_interleave=8)
    _assert_same(_prepared(Pull, cfg, got), prepare_pull_weights(w13, w2))


def test_pull_canonical_pack_with_matching_gate_up_scales_equals_the_recipe() -> None:
    # Every 64-row half block holds one element of the block's max magnitude, so each gate
    # row block's scale equals the up block's and both groupings give the same values.
    w13, w2 = _weights(1)
    w13 = w13.clamp(-2, 2)
    w13[:, ::64, ::128] = 3.0
    pack = _canonical_pack(w13, w2)
    got = _prepared(Pull, Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(), pack)
    _assert_same(got, prepare_pull_weights(w13, w2))
    deq13, deq2 = dequantize_pull_weights(got)  # type: ignore[arg-type]
    assert torch.equal(deq13, quant.dequantize_fp8_blockwise(pack.w13, pack.w13_scale, block=W))
    assert torch.equal(deq2, quant.dequantize_fp8_blockwise(pack.w2, pack.w2_scale, block=W))


def test_push_canonical_pack_equals_the_recipe() -> None:
    w13, w2 = _weights(2)
    got = _prepared(Push, Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig(), _canonical_pack(w13, w2))
    _assert_same(got, prepare_push_weights(w13, w2))


def test_pull_refuses_a_canonical_pack_whose_gate_and_up_scales_differ() -> None:
    pack = _canonical_pack(*_weights(3))
    with pytest.raises(MoeEpUsageError, match=r"expert 0, row block 0, column block 0") as exc:
        Pull.validate_weights(pack, FLEET, 1, Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig())
    assert "prequantized_fc1_gate_up_interleave=8" in str(exc.value)


def test_push_refuses_a_pack_quantized_over_interleaved_rows() -> None:
    pack = _paired_pack(*_weights(), 8)
    with pytest.raises(MoeEpUsageError, match=r"canonical 128x128 .* interleave 8"):
        check_prequantized_pack("push", pack, pack_fc1_interleave=8, kernel_fc1_interleave=None)


def _broken(kind: str) -> MoEWeightPack:
    """A canonical pack (of weights whose gate/up scales match) with one thing wrong."""
    w13, w2 = _weights(4)
    w13 = w13.clamp(-2, 2)
    w13[:, ::64, ::128] = 3.0
    p = _canonical_pack(w13, w2)
    parts = {"w13": p.w13, "w2": p.w2, "w13_scale": p.w13_scale, "w2_scale": p.w2_scale}
    if kind == "e5m2":
        parts["w13"] = quant.quantize_fp8_blockwise(w13, block=W, dtype=torch.float8_e5m2)[0]
    elif kind == "bf16_w2":
        parts["w2"] = w2
    elif kind == "e8m0_scales":
        parts["w2_scale"] = torch.full_like(p.w2_scale, 127, dtype=torch.uint8)
    elif kind == "1x128_blocks":
        parts["w13_scale"] = quant.quantize_fp8_blockwise(w13, block=(1, 128))[1]
    elif kind == "nan_scale":
        parts["w2_scale"] = p.w2_scale.clone()
        parts["w2_scale"][1, 0, 0] = float("nan")
    return MoEWeightPack(**parts)


@pytest.mark.parametrize("cls", [Pull, Push], ids=["pull", "push"])
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("e5m2", r"w13 dtype must be one of \(float8_e4m3fn\) .* got torch.float8_e5m2"),
        ("bf16_w2", r"w2 dtype must be one of \(float8_e4m3fn\) .* got torch.bfloat16"),
        ("e8m0_scales", r"w2_scale must hold fp32 block scales .* got torch.uint8"),
        ("1x128_blocks", r"w13_scale must be float32 \[2, 2, 2\].* \(1x128 blocks\)"),
        ("nan_scale", r"w2_scale has non-finite values"),
    ],
    ids=lambda v: v if " " not in v else "",
)
def test_mismatched_packs_are_refused_before_any_collective(
    cls: type, kind: str, message: str
) -> None:
    cfg = (
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig
        if cls is Pull
        else Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig
    )()
    with pytest.raises(MoeEpUsageError, match=message):
        cls.validate_weights(_broken(kind), FLEET, 1, cfg)  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [4, 64, True, "8"])
def test_pack_interleave_knob_is_validated(value: object) -> None:
    with pytest.raises(MoeEpUsageError, match="prequantized_fc1_gate_up_interleave must be"):
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(
            prequantized_fc1_gate_up_interleave=value  # type: ignore[arg-type]
        )


def test_rank_slices_of_a_pack_reach_the_kernels_16_byte_aligned():
    # One rank's experts sliced from a global pack start mid-allocation: with H/128 = 9 and
    # I/128 = 3 an expert's w2_scale is 27 fp32 = 108 bytes, so expert 1 starts misaligned
    # for the kernels' assumed 16-byte alignment. The prepared tensors are aligned copies
    # with the same values.
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.layout import pull_weights_from_pack
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.layout import push_weights_from_pack

    g = torch.Generator().manual_seed(4)
    h, inter = 9 * 128, 3 * 128
    w13 = torch.randn(2, 2 * inter, h, generator=g).to(torch.bfloat16)
    w2 = torch.randn(2, h, inter, generator=g).to(torch.bfloat16)
    full = _paired_pack(w13, w2, 8)
    part = MoEWeightPack(
        w13=full.w13[1:], w2=full.w2[1:], w13_scale=full.w13_scale[1:], w2_scale=full.w2_scale[1:]
    )
    assert part.w2_scale.data_ptr() % 16 != 0 and part.w13_scale.data_ptr() % 16 != 0
    for got, want in (
        (pull_weights_from_pack(part, pack_fc1_interleave=8), part),
        (push_weights_from_pack(part), part),
    ):
        for t in (got.w13, got.w13_scales, got.w2, got.w2_scales):
            assert t.data_ptr() % 16 == 0
        assert torch.equal(got.w2_scales, want.w2_scale)
    assert torch.equal(push_weights_from_pack(part).w13_scales, part.w13_scale)
    assert torch.equal(
        pull_weights_from_pack(part, pack_fc1_interleave=8).w13_scales, part.w13_scale
    )
    # an aligned pack is used as is (no copy)
    aligned = _canonical_pack(*_weights())
    assert push_weights_from_pack(aligned).w2_scales.data_ptr() == aligned.w2_scale.data_ptr()

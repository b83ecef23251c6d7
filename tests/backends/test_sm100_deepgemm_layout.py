"""Kernel-ready weights and staged inputs of the DeepGEMM fp8 x fp4 mega-MoE, on CPU.

Independent expectations: a scalar reference of the ceil-rule E8M0 byte, the kernel's scale
addressing written out (gate/up interleave by 8, UTCCP row permutation, 4 bytes per int32,
MN-major strides), and the portable `any_fp8_fp4_bf16_torch` recipe's weights, which the
kernel's must equal exactly once the layout is undone.
"""

from __future__ import annotations

import math

import pytest
import torch
from backend_testing import assert_gpu_staging_equals_cpu
from layout_references import dequantize_deepgemm_weights, unpack_ue8m0, utccp_rows_inverse

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.layout import (
    pack_ue8m0,
    prepare_deepgemm_weights,
    stage_deepgemm_inputs,
    utccp_rows,
)

E, I, H = 2, 128, 256  # noqa: E741 - the glossary names (I = intermediate)


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
    return w13, w2


def _e8m0_ref(block: torch.Tensor, fmax: float) -> int:
    """Scalar reference: byte = 127 + ceil(log2(amax / fmax)), 0 for an all-zero block."""
    amax = float(block.abs().max())
    if amax == 0:
        return 0
    exp = math.ceil(math.log2(amax / fmax))
    while 2.0 ** (exp - 1) * fmax >= amax:  # guard float log2 rounding up
        exp -= 1
    while 2.0**exp * fmax < amax:
        exp += 1
    return exp + 127


def _byte(t: torch.Tensor, row: int, c: int, j: int) -> int:
    """Byte j (little-endian) of int32 t[row, c]."""
    return (int(t[row, c]) >> (8 * j)) & 0xFF


def test_weight_shapes_dtypes_and_strides():
    w13, w2 = _weights()
    p = prepare_deepgemm_weights(w13, w2)
    assert p.w13.dtype == p.w2.dtype == torch.int8
    assert p.w13.shape == (E, 2 * I, H // 2) and p.w13.is_contiguous()
    assert p.w2.shape == (E, H, I // 2) and p.w2.is_contiguous()
    for sf, mn, k in ((p.w13_scales, 2 * I, H), (p.w2_scales, H, I)):
        assert sf.dtype == torch.int32 and sf.shape == (E, mn, k // 128)
        # deep_gemm's check_sf_layout: MN-major, TMA-aligned, dense per expert.
        assert sf.stride() == (mn * (k // 128), 1, mn)


def test_fc1_scale_addressing_matches_the_kernel_layout():
    w13, w2 = _weights(3)
    p = prepare_deepgemm_weights(w13, w2)
    for r in (0, 1, 4, 5, 31, 127, 128, 133, 2 * I - 1):
        group, q = divmod(r, 128)
        j, i = divmod(q, 4)  # kernel row 4j + i holds interleaved row 32i + j
        p_row = group * 128 + 32 * i + j
        pair, lane = divmod(p_row, 16)  # interleaved row -> gate/up source row
        src = pair * 8 + lane % 8 + (I if lane >= 8 else 0)
        for c in (0, H // 128 - 1):
            for b in range(4):
                blk = w13[1, src, 32 * (4 * c + b) : 32 * (4 * c + b + 1)].float()
                assert _byte(p.w13_scales[1], r, c, b) == _e8m0_ref(blk, 6.0), (r, c, b)
    # FC2: no interleave, UTCCP only.
    r = 6  # j=1, i=2 -> row 65
    assert _byte(p.w2_scales[0], r, 0, 1) == _e8m0_ref(w2[0, 65, 32:64].float(), 6.0)


def test_fc1_payload_rows_are_gate_up_interleaved_by_8():
    from moe_ep.quant import quantize_mxfp4

    w13, w2 = _weights(4)
    p = prepare_deepgemm_weights(w13, w2)
    packed, _ = quantize_mxfp4(w13)
    assert torch.equal(p.w13[0, 0:8].view(torch.uint8), packed[0, 0:8])
    assert torch.equal(p.w13[0, 8:16].view(torch.uint8), packed[0, I : I + 8])
    assert torch.equal(p.w13[1, 16:24].view(torch.uint8), packed[1, 8:16])
    assert torch.equal(p.w2.view(torch.uint8), quantize_mxfp4(w2)[0])


def test_weights_equal_the_portable_fp8_fp4_recipe_exactly():
    from moe_ep.backends.portable.recipes import Fp8Fp4Recipe
    from moe_ep.types import MoEWeightPack

    w13, w2 = _weights(1)
    got13, got2 = dequantize_deepgemm_weights(prepare_deepgemm_weights(w13, w2))
    portable = Fp8Fp4Recipe().prepare(MoEWeightPack(w13=w13, w2=w2))
    assert torch.equal(got13.transpose(1, 2), portable.w13t)
    assert torch.equal(got2.transpose(1, 2), portable.w2t)


def test_prequantized_pack_is_relaid_out_without_requantizing():
    from moe_ep.quant import quantize_mxfp4

    w13, w2 = _weights(2)
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    a = prepare_deepgemm_weights(q13, q2, s13, s2)
    b = prepare_deepgemm_weights(w13, w2)
    for name in ("w13", "w13_scales", "w2", "w2_scales"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(MoeEpUsageError, match=r"w13_scale must be \[2, 256, 8\]"):
        prepare_deepgemm_weights(q13, q2, s13[..., :4], s2)
    with pytest.raises(MoeEpUsageError, match="packed mxfp4 uint8"):
        prepare_deepgemm_weights(w13, w2, s13, s2)


def test_shape_rules():
    w13, w2 = _weights()
    with pytest.raises(MoeEpUsageError, match="multiples of 128"):
        prepare_deepgemm_weights(w13[:, :, :160].contiguous(), w2[:, :160].contiguous())
    with pytest.raises(MoeEpUsageError, match="3-D"):
        prepare_deepgemm_weights(w13[0], w2)


def test_pack_and_utccp_round_trip():
    g = torch.Generator().manual_seed(7)
    s = torch.randint(0, 255, (2, 256, 8), generator=g, dtype=torch.int64).to(torch.uint8)
    packed = pack_ue8m0(s)
    assert packed.shape == (2, 256, 2)
    assert _byte(packed[1], 9, 1, 3) == int(s[1, 9, 7])
    assert torch.equal(unpack_ue8m0(utccp_rows_inverse(utccp_rows(packed))), s)
    with pytest.raises(MoeEpUsageError, match="multiple of 4"):
        pack_ue8m0(s[..., :6])


def test_staged_inputs_bytes_and_padding():
    from moe_ep.quant import dequantize_fp8_blockwise, quantize_fp8_blockwise

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, H, generator=g) * 4).to(torch.bfloat16)
    x[1, 32:64] = 0  # an all-zero block: byte 0
    ids = torch.tensor([[0, -1], [3, 1], [2, 2]])
    w = torch.rand(3, 2, generator=g)
    st = stage_deepgemm_inputs(x, ids, w, max_tokens=5)
    assert st.num_tokens == 3
    assert st.activation.dtype == torch.float8_e4m3fn and st.activation.shape == (5, H)
    assert st.activation_scales.dtype == torch.int32 and st.activation_scales.shape == (5, H // 128)
    assert st.topk_ids.dtype == torch.int64 and st.topk_ids.shape == (5, 2)
    for r in range(3):
        for blk in (0, 1, 5, H // 32 - 1):
            want = _e8m0_ref(x[r, 32 * blk : 32 * blk + 32].float(), 448.0)
            assert _byte(st.activation_scales, r, blk // 4, blk % 4) == want, (r, blk)
    # The fp8 1x32 UE8M0 blockwise quantizer (another code path) gives the same values.
    data, scales = quantize_fp8_blockwise(x, block=(1, 32), scale_format="ue8m0")
    assert torch.equal(st.activation[:3].view(torch.uint8), data.view(torch.uint8))
    from moe_ep.quant import e8m0_to_float32

    staged_scales = e8m0_to_float32(unpack_ue8m0(st.activation_scales[:3]))
    assert torch.equal(
        dequantize_fp8_blockwise(st.activation[:3], staged_scales, block=(1, 32)),
        dequantize_fp8_blockwise(data, scales, block=(1, 32)),
    )
    assert not st.activation[3:].view(torch.uint8).any() and not st.activation_scales[3:].any()
    assert st.topk_ids.tolist() == [[0, -1], [3, 1], [2, 2], [-1, -1], [-1, -1]]
    assert float(st.topk_weights[0, 1]) == 0.0 and float(st.topk_weights[1, 0]) == float(w[1, 0])
    assert not st.topk_weights[3:].any()


def test_staging_zero_tokens_and_bad_inputs():
    st = stage_deepgemm_inputs(
        torch.zeros(0, H, dtype=torch.bfloat16),
        torch.zeros(0, 4, dtype=torch.int64),
        torch.zeros(0, 4),
        max_tokens=4,
    )
    assert st.num_tokens == 0 and int(st.topk_ids.max()) == -1
    with pytest.raises(MoeEpUsageError, match="multiple of 128"):
        stage_deepgemm_inputs(
            torch.zeros(1, 96, dtype=torch.bfloat16),
            torch.zeros(1, 1, dtype=torch.int64),
            torch.zeros(1, 1),
            max_tokens=4,
        )


def test_gpu_staging_bytes_equal_cpu():
    assert_gpu_staging_equals_cpu(stage_deepgemm_inputs, 512)


def test_portable_fp8_fp4_activations_equal_the_staged_kernel_inputs():
    """The oracle recipe quantizes FC1 and FC2 inputs as the kernel does (1x32 UE8M0)."""
    from moe_ep.backends.portable.recipes import Fp8Fp4Recipe
    from moe_ep.quant import dequantize_fp8_blockwise, e8m0_to_float32

    g = torch.Generator().manual_seed(8)
    x = (torch.randn(6, H, generator=g) * 3).to(torch.bfloat16)
    x[2, 64:96] = 100.0  # one loud 32-block: a 1x128 recipe would coarsen its neighbours
    recipe = Fp8Fp4Recipe()
    portable = recipe.unpack(recipe.pack(x), H)
    st = stage_deepgemm_inputs(
        x, torch.zeros(6, 1, dtype=torch.int64), torch.ones(6, 1), max_tokens=6
    )
    kernel = dequantize_fp8_blockwise(
        st.activation, e8m0_to_float32(unpack_ue8m0(st.activation_scales)), block=(1, 32)
    )
    assert torch.equal(portable.float(), kernel.float())
    # FC2 input: the same 1x32 rule on the SwiGLU output
    h = torch.randn(6, I, generator=g) * 2
    h[0, :32] *= 300
    st_h = stage_deepgemm_inputs(
        h.bfloat16(), torch.zeros(6, 1, dtype=torch.int64), torch.ones(6, 1), max_tokens=6
    )
    want = dequantize_fp8_blockwise(
        st_h.activation, e8m0_to_float32(unpack_ue8m0(st_h.activation_scales)), block=(1, 32)
    )
    assert torch.equal(recipe.requantize(h.bfloat16().float()).float(), want.float())

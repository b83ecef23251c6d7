"""The sm90 MXFP4 x FP8 kernel's logical weight ABI (`sm90_fp8_mxfp4_bf16_pull_cutedsl.layout`)
against the drop's own e2m1 -> e4m3 expansion and the portable twin's weights, on CPU.

The drop's conversion (`moe_hopper_fp8/mxfp4_cutedsl.py`, `convert_mxfp4_pair_preprocessed_
signs`) is PTX: per 4-bit code, `prmt` picks a byte of two lookup words built by
`mad.lo.u32 lut, offset, MUL, BASE`, and the code's sign bit is or-ed in. Its four constants
are read from the drop's source here and the PTX is restated for one code (our code), so a
layout whose offsets or residual disagree with the drop fails.
"""

from __future__ import annotations

import re

import pytest
import torch
from sm90_mxfp4_cases import drop_mxfp4_source, wide_weights

from moe_ep import quant
from moe_ep.backends.portable.recipes import Fp8Mxfp4Recipe
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import MoEWeightPack
from moe_ep_sm90.common.pull_tiles import PULL_GATE_UP_BLOCK
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.layout import (
    Mxfp4HybridLeg,
    mxfp4_hybrid_leg,
    prepare_mxfp4_hybrid_weights,
    stage_mxfp4_hybrid_inputs,
)


def _drop_luts() -> tuple[tuple[int, int], tuple[int, int]]:
    src = drop_mxfp4_source()
    found = {
        name: (int(mul, 16), int(base, 16))
        for name, mul, base in re.findall(
            r"mad\.lo\.u32 (lo_lut[01]), \$6, (0x[0-9a-f]+), (0x[0-9a-f]+);", src
        )
    }
    assert set(found) == {"lo_lut0", "lo_lut1"}, found
    return found["lo_lut0"], found["lo_lut1"]


def _e4m3_byte(code: int, offset: int) -> int:
    """The drop's PTX for one e2m1 code: lut words = offset * MUL + BASE (mod 2**32); prmt
    selects byte (code & 7) of {lut1:lut0}; the sign bit 3 moves to bit 7."""
    (m0, b0), (m1, b1) = _drop_luts()
    lut0, lut1 = (offset * m0 + b0) % 2**32, (offset * m1 + b1) % 2**32
    word = lut0 | (lut1 << 32)
    return ((word >> (8 * (code & 7))) & 0xFF) | ((code & 0x8) << 4)


def _kernel_values(leg: Mxfp4HybridLeg) -> torch.Tensor:
    """What the kernel's operand times its per-expert residual is, element by element."""
    table = torch.tensor(
        [[_e4m3_byte(c, o) for c in range(16)] for o in range(16)], dtype=torch.uint8
    )
    codes = quant.unpack_e2m1(leg.codes).long()
    offs = leg.offsets.long().repeat_interleave(32, dim=-1)
    e4m3 = table[offs, codes].view(torch.float8_e4m3fn).float()
    return e4m3 * leg.residual64.view(-1, 1, 1)


def test_kernel_view_of_the_layout_is_the_portable_twins_weights() -> None:
    w13, w2 = wide_weights(0, 2, 256, 128), wide_weights(1, 2, 128, 128)  # I=128, H=128
    fc1, fc2 = prepare_mxfp4_hybrid_weights(w13, w2)
    twin = Fp8Mxfp4Recipe().prepare(MoEWeightPack(w13=w13, w2=w2))
    got13 = quant.deinterleave_gate_up(_kernel_values(fc1), PULL_GATE_UP_BLOCK)
    assert torch.equal(got13, twin.w13t.transpose(1, 2))
    assert torch.equal(_kernel_values(fc2), twin.w2t.transpose(1, 2))
    for leg in (fc1, fc2):  # 4-bit offsets that never reach e4m3's NaN exponent
        assert int(leg.offsets.min()) == 1 and int(leg.offsets.max()) == 12


def test_a_prequantized_pack_gives_the_same_layout() -> None:
    w13, w2 = wide_weights(2, 1, 256, 128), wide_weights(3, 1, 128, 128)
    p13, s13 = quant.quantize_mxfp4(w13)
    p2, s2 = quant.quantize_mxfp4(w2)
    a = prepare_mxfp4_hybrid_weights(w13, w2)
    b = prepare_mxfp4_hybrid_weights(p13, p2, s13, s2)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.codes, y.codes) and torch.equal(x.offsets, y.offsets)
        assert torch.equal(x.residual64, y.residual64)


def test_fc1_rows_are_gate_up_interleaved_in_eights() -> None:
    w13 = wide_weights(4, 1, 256, 128)  # I = 128: gate rows 0..127, up rows 128..255
    fc1, _ = prepare_mxfp4_hybrid_weights(w13, wide_weights(5, 1, 128, 128))
    plain = mxfp4_hybrid_leg(*quant.quantize_mxfp4(w13))
    got, want = quant.unpack_e2m1(fc1.codes)[0], quant.unpack_e2m1(plain.codes)[0]
    for pair in range(16):
        assert torch.equal(got[16 * pair : 16 * pair + 8], want[8 * pair : 8 * pair + 8])
        assert torch.equal(
            got[16 * pair + 8 : 16 * pair + 16], want[128 + 8 * pair : 136 + 8 * pair]
        )
    assert torch.equal(fc1.offsets[0, 8:16], plain.offsets[0, 128:136])


def test_staged_inputs_are_the_portable_twins_payload() -> None:
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(5, 256, generator=g) * 3).bfloat16()
    ids = torch.tensor([[0, 3], [1, -1], [2, 2], [-1, -1], [7, 4]])
    wts = torch.rand(5, 2, generator=g)
    st = stage_mxfp4_hybrid_inputs(x, ids, wts, max_tokens=8)
    payload = Fp8Mxfp4Recipe().pack(x)  # e4m3 bytes, then the token's fp32 scale
    assert torch.equal(st.activation[:5].view(torch.uint8), payload[:, :256])
    assert torch.equal(st.activation_scales[:5], payload[:, 256:].view(torch.float32).expand(5, 4))
    assert not st.activation[5:].view(torch.uint8).any() and not st.activation_scales[5:].any()
    assert st.topk_ids.dtype == torch.int64 and st.topk_ids[5:].eq(-1).all()
    assert torch.equal(st.topk_weights[:5], torch.where(ids >= 0, wts, 0.0))
    assert st.num_tokens == 5


def test_staging_refuses_h_off_128_and_too_many_tokens() -> None:
    ids, wts = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    with pytest.raises(MoeEpUsageError, match="multiple of 128"):
        stage_mxfp4_hybrid_inputs(torch.zeros(2, 192).bfloat16(), ids, wts, max_tokens=4)
    with pytest.raises(MoeEpUsageError, match="more than max_tokens=1"):
        stage_mxfp4_hybrid_inputs(torch.zeros(2, 128).bfloat16(), ids, wts, max_tokens=1)

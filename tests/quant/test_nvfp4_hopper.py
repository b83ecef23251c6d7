"""`moe_ep.quant.nvfp4_hopper` (the sm90 NVFP4 x FP8 kernel's weight numerics) bit for bit
against scalar references written here from the rules (quant_ref's e4m3 / e2m1 codecs, exact
rational rounding, fp32 emulation), and the e4m3 operand against the kernel's own conversion
table, restated from its PTX."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from quant_ref import GRIDS, decode_e2m1, decode_e4m3, encode, f32, pack_nibbles

import moe_ep.quant as q
from moe_ep.errors import MoeEpUsageError

RCP_2688 = f32(1.0 / 2688.0)
FLOOR = f32(1e-30)


def ref_decode_scale(amax: float) -> float:
    """G = fp32(amax * fp32(1/2688)), at least fp32(1e-30)."""
    return max(f32(amax * RCP_2688), FLOOR)


def ref_block(vals: list[float], g: float) -> tuple[list[int], int]:
    """One 16-block -> (e2m1 codes, e4m3 scale byte): scale = e4m3(clamp(amax / fp32(6 G),
    0, 448)), code = RNE_e2m1(fp32(v / max(fp32(scale * G), 1e-30))), saturating."""
    amax = max(abs(v) for v in vals)
    s_code = encode(min(f32(amax / f32(6.0 * g)), 448.0), "e4m3")
    divisor = max(f32(decode_e4m3(s_code) * g), FLOOR)
    return [encode(f32(v / divisor), "e2m1") for v in vals], s_code


def _weights(seed: int) -> torch.Tensor:
    """[3, 8, 64] bf16-valued weights: per-expert magnitudes 2**-12 .. 2**6, a zero block,
    a block whose scale rounds to zero, blocks of wide magnitude inside one row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 8, 64, generator=g)
    w *= torch.exp2(torch.tensor([-12.0, 0.0, 6.0])).view(3, 1, 1)
    w *= (
        torch.exp2(-torch.randint(0, 12, (3, 8, 4, 1), generator=g).float())
        .repeat_interleave(16, -1)
        .view(3, 8, 64)
    )
    w[0, 0, :16] = 0.0
    w[1, 1, 16:32] = torch.randn(16, generator=g) * 1e-7  # amax / 6G < 2**-10: scale 0
    w[1, 1, 16] = -w[1, 1, 16].abs()
    return w.bfloat16().float()


def _near_ties(seed: int) -> torch.Tensor:
    """[2, 8, 64] fp32 weights whose block amaxes are e4m3 midpoints times fp32(6G) and whose
    elements are e2m1 midpoints times the block's divisor, each +-1 fp32 ulp or exact: where
    a reciprocal multiply in place of either division gives other bits."""
    g = torch.Generator().manual_seed(seed)
    e4m3 = [v for v in GRIDS["e4m3"][0] if v >= 2.0**-6]
    mids = [(a + b) / 2 for a, b in itertools.pairwise(e4m3)]
    e2m1_mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]

    def pick(n: int) -> int:
        return int(torch.randint(n, (), generator=g))

    def nudge(v: float) -> float:
        return [v, math.nextafter(v, math.inf), math.nextafter(v, 0.0)][pick(3)]

    w = torch.zeros(2, 8, 64)
    for e in range(2):
        top = f32(1000.0 * 2.0 ** (6 * e - 3))
        gs = ref_decode_scale(top)
        six_g = f32(6.0 * gs)
        for r in range(8):
            for b in range(4):
                amax = nudge(f32(mids[pick(len(mids))] * six_g))
                s_code = encode(min(f32(amax / six_g), 448.0), "e4m3")
                divisor = f32(decode_e4m3(s_code) * gs)
                vals = [amax] + [nudge(f32(e2m1_mids[pick(7)] * divisor)) for _ in range(15)]
                w[e, r, 16 * b : 16 * b + 16] = torch.tensor(vals) * (1 - 2 * (r % 2))
        w[e, 0, 0] = top
    return w


def test_decode_scale_is_the_product_with_a_rounded_reciprocal() -> None:
    # every positive finite bf16 amax: fp32(amax * fp32(1/2688)), which is not amax / 2688
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    amax = bits.float()
    got = q.nvfp4_decode_scale(amax.view(-1, 1), dim=-1).flatten()
    want = torch.tensor([ref_decode_scale(a) for a in amax.tolist()], dtype=torch.float32)
    assert torch.equal(got, want)
    assert bool((got != (amax / 2688.0).clamp_min(FLOOR)).any())
    w = _weights(0)
    per_expert = q.nvfp4_decode_scale(w, dim=(-2, -1))
    assert per_expert.shape == (3, 1, 1)
    want_g = [ref_decode_scale(float(w[e].abs().max())) for e in range(3)]
    assert per_expert.flatten().tolist() == want_g
    assert float(q.nvfp4_decode_scale(torch.zeros(4))) == FLOOR


def _check_against_the_reference(w: torch.Tensor) -> tuple[int, int]:
    """Codes and scales of `w` [E, 8, 64] equal `ref_block`'s; returns how many scales and
    codes a reciprocal multiply would have changed."""
    g = q.nvfp4_decode_scale(w, dim=(-2, -1))
    packed, scales = q.quantize_nvfp4_decode_scaled(w, decode_scale=g)
    e_n = int(w.shape[0])
    assert packed.shape == (e_n, 8, 32) and scales.shape == (e_n, 8, 4)
    assert scales.dtype == torch.float8_e4m3fn
    scale_rcp = code_rcp = 0
    for e in range(e_n):
        ge = float(g[e])
        for r in range(8):
            codes = []
            for b in range(4):
                block = w[e, r, 16 * b : 16 * b + 16].tolist()
                c, s = ref_block(block, ge)
                assert int(scales[e, r, b].view(torch.uint8)) == s, (e, r, b)
                codes += c
                amax = max(abs(v) for v in block)
                six_g = f32(6.0 * ge)
                scale_rcp += s != encode(min(f32(amax * f32(1.0 / six_g)), 448.0), "e4m3")
                d = max(f32(decode_e4m3(s) * ge), FLOOR)
                code_rcp += c != [encode(f32(v * f32(1.0 / d)), "e2m1") for v in block]
            assert packed[e, r].tolist() == pack_nibbles(codes), (e, r)
    return scale_rcp, code_rcp


def test_quantizer_matches_the_reference() -> None:
    _check_against_the_reference(_weights(1))
    w = _weights(1)
    g = q.nvfp4_decode_scale(w, dim=(-2, -1))
    packed, scales = q.quantize_nvfp4_decode_scaled(w, decode_scale=g)
    assert int(scales[1, 1, 1].view(torch.uint8)) == 0  # the scale that rounds to zero
    assert q.unpack_e2m1(packed)[1, 1, 16:32].tolist().count(15) >= 1  # saturated, -6
    # the sm100 rule with norm_const = 1 / G gives other bits: the division rule matters
    nc = (1.0 / g).float()
    p100, s100 = q.quantize_nvfp4(w, norm_const=nc)
    scales_differ = int((s100.view(torch.uint8) != scales.view(torch.uint8)).sum())
    assert int((p100 != packed).sum()) + scales_differ > 0


def test_quantizer_divides_where_a_reciprocal_multiply_would_round_otherwise() -> None:
    scale_rcp, code_rcp = _check_against_the_reference(_near_ties(4))
    assert scale_rcp > 0 and code_rcp > 0  # the inputs tell the two rules apart


def test_operand_is_rn_e4m3_of_code_times_scale_over_8_on_every_pair() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    for s in range(127):
        packed = q.pack_e2m1(codes.view(1, 16))
        scale = torch.tensor([[s]], dtype=torch.uint8).view(torch.float8_e4m3fn)
        got = q.nvfp4_e4m3_operand(packed, scale).view(torch.uint8).flatten().tolist()
        want = [encode(decode_e2m1(c) * decode_e4m3(s) / 8, "e4m3") for c in range(16)]
        assert got == want, s


def _kernel_lut(s: int) -> list[int]:
    """The eight e4m3 candidates the kernel builds for scale byte `s` (codes 0..7), restated
    from flashinfer 0.7.4 `kernel_src/sm90/pull_style_cutedsl_megakernel/shim/
    nvfp4_conversion.py` HIGH_ASM: bytes >= 40 by integer arithmetic on the byte and a
    mantissa table (the 1.5 * s / 8 candidate), smaller ones as fp32 products
    `s * {0, 1/16, ..., 3/4}` converted by `cvt.rn.satfinite.e4m3x2.f32`."""
    if s >= 40:
        c = ((0x43424241403F3E3C >> (8 * (s & 7))) & 0xFF) + (s & 120) - 80
        b = s - 24
        return [0, b - 8, b, c, b + 8, c + 8, b + 16, c + 16]
    sf = decode_e4m3(s)
    return [encode(sf * m, "e4m3") for m in (0, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 3 / 4)]


def test_operand_equals_the_kernels_conversion_table() -> None:
    codes = torch.arange(16, dtype=torch.uint8).view(1, 16)
    for s in range(127):
        scale = torch.tensor([[s]], dtype=torch.uint8).view(torch.float8_e4m3fn)
        got = q.nvfp4_e4m3_operand(q.pack_e2m1(codes), scale).view(torch.uint8).flatten()
        lut = _kernel_lut(s)
        # the kernel ORs the code's sign bit (bit 3) into bit 7 of the candidate
        assert got.tolist() == lut + [v | 0x80 for v in lut], s


def test_refuses_bad_arguments() -> None:
    w = torch.randn(2, 4, 32)
    with pytest.raises(MoeEpUsageError, match="decode_scale must be positive"):
        q.quantize_nvfp4_decode_scaled(w, decode_scale=torch.zeros(2, 1, 1))
    with pytest.raises(MoeEpUsageError, match="does not broadcast"):
        q.quantize_nvfp4_decode_scaled(w, decode_scale=torch.ones(3, 1, 1))
    with pytest.raises(MoeEpUsageError, match="divisible by the nvfp4 block"):
        q.quantize_nvfp4_decode_scaled(torch.randn(2, 24), decode_scale=torch.ones(()))
    with pytest.raises(MoeEpUsageError, match="NaN or inf"):
        bad = w.masked_fill(w > 1, float("inf"))
        q.quantize_nvfp4_decode_scaled(bad, decode_scale=torch.ones(()))
    p, s = q.quantize_nvfp4_decode_scaled(w, decode_scale=torch.ones(()))
    with pytest.raises(MoeEpUsageError, match="scales"):
        q.nvfp4_e4m3_operand(p, s[..., :1])


# ---------------------------------------------------------------- the portable recipe


def _ref_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (the kernel's operand values RN_E4M3(code * scale / 8), 8 * G), from the
    references."""
    e, n, k = w.shape
    vals = []
    alpha = []
    for i in range(e):
        g = ref_decode_scale(float(w[i].abs().max()))
        alpha.append(f32(8.0 * g))
        rows = []
        for r in range(n):
            row = []
            for b in range(k // 16):
                codes, s = ref_block(w[i, r, 16 * b : 16 * b + 16].tolist(), g)
                sf = decode_e4m3(s)
                row += [decode_e4m3(encode(decode_e2m1(c) * sf / 8, "e4m3")) for c in codes]
            rows.append(row)
        vals.append(rows)
    return torch.tensor(vals, dtype=torch.float32), torch.tensor(alpha, dtype=torch.float32)


def test_recipe_weights_from_bf16_and_from_a_prequantized_pack() -> None:
    from moe_ep.backends.portable.recipes import Fp8Nvfp4Recipe
    from moe_ep.types import MoEWeightPack

    w13, w2 = _weights(2), _weights(3)
    prepared = Fp8Nvfp4Recipe().prepare(MoEWeightPack(w13=w13, w2=w2))
    legs = ((prepared.w13t, prepared.alpha13, w13), (prepared.w2t, prepared.alpha2, w2))
    for got, alpha, w in legs:
        want, want_alpha = _ref_weight(w)
        assert torch.equal(got.transpose(1, 2), want)
        assert alpha is not None and torch.equal(alpha, want_alpha)
    assert prepared.stored13 is not None and prepared.stored13.code == "e4m3"
    assert torch.equal(
        prepared.stored13.codes.view(torch.float8_e4m3fn).float(), prepared.w13t.transpose(1, 2)
    )
    # a pre-quantized pack: codes, e4m3 scales, the decode scales G
    packs = {}
    for name, w in (("w13", w13), ("w2", w2)):
        g = q.nvfp4_decode_scale(w, dim=(-2, -1))
        packs[name] = (*q.quantize_nvfp4_decode_scaled(w, decode_scale=g), g.flatten())
    (p13, s13, g13), (p2, s2, g2) = packs["w13"], packs["w2"]
    pre = Fp8Nvfp4Recipe().prepare(
        MoEWeightPack(p13, p2, s13, s2, w13_global_scale=g13, w2_global_scale=g2)
    )
    assert torch.equal(pre.w13t, prepared.w13t) and torch.equal(pre.w2t, prepared.w2t)
    assert torch.equal(pre.alpha13, prepared.alpha13) and torch.equal(pre.alpha2, prepared.alpha2)
    # without global scales G = 1, so alpha = 8
    plain = Fp8Nvfp4Recipe().prepare(MoEWeightPack(p13, p2, s13, s2))
    assert plain.alpha13 is not None and plain.alpha13.tolist() == [8.0] * 3


def test_recipe_refuses_negative_scales_and_bad_decode_scales() -> None:
    from moe_ep.backends.portable.recipes import Fp8Nvfp4Recipe
    from moe_ep.types import MoEWeightPack

    recipe = Fp8Nvfp4Recipe()
    with pytest.raises(MoeEpUsageError, match="multiples of 128"):
        recipe.check_dims(256, 64)
    p13, s13 = q.quantize_nvfp4_decode_scaled(torch.randn(1, 256, 128), decode_scale=torch.ones(()))
    p2, s2 = q.quantize_nvfp4_decode_scaled(torch.randn(1, 128, 128), decode_scale=torch.ones(()))
    bad = s13.view(torch.uint8).clone()
    bad[0, 0, 0] = 0x81  # a negative e4m3 scale
    with pytest.raises(MoeEpUsageError, match="w13_scale holds negative or NaN"):
        recipe.check_scales(MoEWeightPack(w13=p13, w2=p2, w13_scale=bad, w2_scale=s2))
    with pytest.raises(MoeEpUsageError, match=r"w2_global_scale .* positive finite"):
        recipe.check_scales(
            MoEWeightPack(p13, p2, s13, s2, torch.ones(1), w2_global_scale=torch.zeros(1))
        )

"""`moe_ep.quant.mxfp4_hybrid` (the sm90 MXFP4 x FP8 kernel's numerics) bit for bit against
scalar references written here from the rules (quant_ref's e4m3 / e2m1 codecs and fp32
emulation), with inputs chosen where a near-miss rule gives other bits."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from quant_ref import GRIDS, decode_e2m1, decode_e4m3, encode, f32, mx_block, pack_nibbles

import moe_ep.quant as q
from moe_ep.errors import MoeEpUsageError

RCP_448 = f32(1.0 / 448.0)


def hybrid_scale(amax: float) -> float:
    """fp32(amax * fp32(1/448)), floored at fp32(1e-30)."""
    return max(f32(amax * RCP_448), f32(1e-30))


def ref_per_token(row: list[float]) -> tuple[list[int], float]:
    s = hybrid_scale(max(abs(v) for v in row))
    return [encode(f32(v / s), "e4m3") for v in row], s


def ref_fc2_block(block: list[float]) -> tuple[list[int], float]:
    s = hybrid_scale(max(abs(v) for v in block))
    r = f32(1.0 / s)
    return [encode(f32(v * r), "e4m3") for v in block], s


def _bytes(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).reshape(-1).tolist()


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.exp2(torch.randint(-20, 20, (rows, 1), generator=g).float())
    x = torch.randn(rows, k, generator=g) * scales
    x[0] = 0.0  # all-zero row: the 1e-30 floor
    x[1, :] = 0.0
    x[1, 3] = 1e-33  # tiny amax: scale is the floor, elements x / 1e-30
    return x


def test_per_token_scale_and_codes_match_the_reference() -> None:
    x = _activations(64, 256, seed=0)
    data, scale = q.quantize_fp8_per_token_hybrid(x)
    assert data.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    division_differs = 0
    for r in range(x.shape[0]):
        row = x[r].tolist()
        codes, s = ref_per_token(row)
        assert float(scale[r, 0]) == s, r
        assert _bytes(data[r]) == codes, r
        amax = max(abs(v) for v in row)
        division_differs += amax > 0 and f32(amax / 448.0) != f32(amax * RCP_448)
    # the multiply by a rounded 1/448 is not amax / 448 on some of these rows
    assert division_differs > 0
    back = q.dequantize_fp8_per_row(data, scale)
    want = torch.tensor(
        [[decode_e4m3(c) * float(scale[r, 0]) for c in _bytes(data[r])] for r in range(64)]
    )
    assert torch.equal(back, want.float())


def _near_midpoints(rows: int, seed: int) -> torch.Tensor:
    """Rows of 64 whose first element sets the scale s and whose others are e4m3 midpoints
    times s and their fp32 neighbours: where `x * fp32(1/s)` and `x / s` round apart."""
    g = torch.Generator().manual_seed(seed)
    mids = [(a + b) / 2 for a, b in zip(GRIDS["e4m3"][0], GRIDS["e4m3"][0][1:], strict=False)]
    out = []
    for _ in range(rows):
        amax = f32(
            float(torch.rand((), generator=g)) * 2.0 ** int(torch.randint(-8, 8, (), generator=g))
            + 1e-3
        )
        s = hybrid_scale(amax)
        picks = torch.randint(0, len(mids), (21,), generator=g).tolist()
        vals = [amax]
        for i in picks:
            v = f32(mids[i] * s)
            vals += [v, math.nextafter(v, math.inf), math.nextafter(v, -math.inf)]
        out.append([f32(v) for v in vals[:64]])
    return torch.tensor(out, dtype=torch.float32).clamp(max=torch.tensor(out)[:, :1])


def test_fc2_blocks_multiply_by_the_reciprocal_scale() -> None:
    x = torch.cat([_activations(16, 192, seed=1), _near_midpoints(16, seed=4).repeat(1, 3)])
    data, scales = q.quantize_fp8_fc2_hybrid(x)
    assert scales.shape == (32, 3)
    via_division = 0
    for r in range(32):
        for b in range(3):
            block = x[r, 64 * b : 64 * b + 64].tolist()
            codes, s = ref_fc2_block(block)
            assert float(scales[r, b]) == s, (r, b)
            assert _bytes(data[r, 64 * b : 64 * b + 64]) == codes, (r, b)
            via_division += codes != [encode(f32(v / s), "e4m3") for v in block]
    assert via_division > 0  # x * fp32(1/scale) is not x / scale somewhere here


def test_fc2_block_must_divide_the_row() -> None:
    with pytest.raises(MoeEpUsageError, match="multiple of 64"):
        q.quantize_fp8_fc2_hybrid(torch.ones(2, 96))


def test_nonfinite_rows_get_a_nan_scale_only_there() -> None:
    x = torch.randn(3, 128)
    x[1, 5] = math.inf
    data, scale = q.quantize_fp8_per_token_hybrid(x, check_finite=False)
    back = q.dequantize_fp8_per_row(data, scale)
    assert bool(torch.isnan(back[1]).all())
    assert torch.equal(
        data[[0, 2]].view(torch.uint8),
        q.quantize_fp8_per_token_hybrid(x[[0, 2]])[0].view(torch.uint8),
    )
    with pytest.raises(MoeEpUsageError):
        q.quantize_fp8_per_token_hybrid(x)


# ---------------------------------------------------------------- the exponent-range clamp


def ref_round_e2m1_ties_away(v: float) -> int:
    """Nearest e2m1 magnitude code of v >= 0, a tie going to the larger magnitude."""
    vals, codes = GRIDS["e2m1"]
    best = min(range(len(vals)), key=lambda i: (abs(Fraction(v) - Fraction(vals[i])), -vals[i]))
    return codes[best]


def ref_clamp(codes: list[list[list[int]]], scales: list[list[list[int]]], max_range: int):
    """Per expert: floor = max byte - max_range; a block at byte b < floor takes the floor and
    each element value * 2**-(floor - b) rounded to e2m1 (ties away); -0 becomes +0."""
    out_codes, out_scales = [], []
    for ce, se in zip(codes, scales, strict=True):
        floor = max(b for row in se for b in row) - max_range
        rc, rs = [], []
        for crow, srow in zip(ce, se, strict=True):
            new_row = []
            for j, c in enumerate(crow):
                b = srow[j // 32]
                delta = max(floor - b, 0)
                mag = ref_round_e2m1_ties_away(abs(decode_e2m1(c)) * 2.0**-delta)
                new_row.append(0 if mag == 0 else mag | (c & 0x8))
            rc.append(new_row)
            rs.append([max(b, floor) for b in srow])
        out_codes.append(rc)
        out_scales.append(rs)
    return out_codes, out_scales


def _weights_with_wide_exponents(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(2, 8, 128, generator=g)
    # blocks 0..20 binades below the largest: some are clamped, some by exactly one step
    w = w * torch.exp2(-torch.randint(0, 21, (2, 8, 4, 1), generator=g).float()).repeat_interleave(
        32, -1
    ).view(2, 8, 128)
    return w


def test_clamp_matches_the_reference_including_ties() -> None:
    w = _weights_with_wide_exponents(seed=2)
    packed, scales = q.quantize_mxfp4(w)
    # plant exact ties: in expert 0, row 0 block 1 sits one step below the floor, with
    # elements 0.5 and 1.0 * 2**b (-> 0.25, a tie between 0 and 0.5, and 0.5) and 1.5 (-> 0.75)
    s = scales.clone()
    top = int(s[0].max())
    s[0, 0, 1] = top - 12
    codes = q.unpack_e2m1(packed).clone()
    codes[0, 0, 32:35] = torch.tensor([1, 2, 3], dtype=torch.uint8)  # 0.5, 1.0, 1.5
    codes[0, 0, 35] = 9  # -0.5 -> -0.25, a tie: -0.5
    packed = q.pack_e2m1(codes)
    got_p, got_s = q.clamp_mxfp4_exponent_range(packed, s)
    want_c, want_s = ref_clamp(
        codes.tolist(), [[[int(b) for b in row] for row in e] for e in s.tolist()], 11
    )
    assert got_s.tolist() == want_s
    assert q.unpack_e2m1(got_p).tolist() == want_c
    assert q.unpack_e2m1(got_p)[0, 0, 32:36].tolist() == [1, 1, 2, 9]  # ties away from zero
    clamped = (got_s != s).sum()
    assert int(clamped) > 4  # the draw really exercises the clamp


def test_clamp_keeps_narrow_experts_and_zeroes_negative_zero() -> None:
    w = torch.randn(1, 4, 64)
    packed, scales = q.quantize_mxfp4(w)
    codes = q.unpack_e2m1(packed).clone()
    codes[0, 0, 0] = 8  # -0
    got_p, got_s = q.clamp_mxfp4_exponent_range(q.pack_e2m1(codes), scales)
    assert torch.equal(got_s, scales)
    want = torch.where(codes == 8, 0, codes)  # every -0 (quantize_mxfp4 makes some too)
    assert bool((codes == 8).any())
    assert torch.equal(q.unpack_e2m1(got_p), want)


def test_clamp_refuses_bad_arguments() -> None:
    p, s = q.quantize_mxfp4(torch.randn(1, 2, 64))
    with pytest.raises(MoeEpUsageError, match="max_range"):
        q.clamp_mxfp4_exponent_range(p, s, max_range=12)
    with pytest.raises(MoeEpUsageError, match="scales"):
        q.clamp_mxfp4_exponent_range(p, s[:, :, :1])


def test_mxfp4_before_the_clamp_is_the_ocp_block_format() -> None:
    """The weights the clamp starts from: e2m1 + E8M0 per 32 (ceil rule), as defined."""
    w = _weights_with_wide_exponents(seed=3)
    packed, scales = q.quantize_mxfp4(w)
    for e in range(2):
        for r in range(8):
            codes = []
            for b in range(4):
                c, byte = mx_block(w[e, r, 32 * b : 32 * b + 32].tolist(), "e2m1", "ceil")
                assert int(scales[e, r, b]) == byte
                codes += c
            assert packed[e, r].tolist() == pack_nibbles(codes)


# ---------------------------------------------------------------- the portable recipe


def _ref_weight(w: torch.Tensor) -> torch.Tensor:
    """[E, N, K] -> dequantized mxfp4 (ceil rule) after the per-expert clamp, from the refs."""
    e, n, k = w.shape
    codes = [[[] for _ in range(n)] for _ in range(e)]
    scales = [[[] for _ in range(n)] for _ in range(e)]
    for i in range(e):
        for r in range(n):
            for b in range(k // 32):
                c, byte = mx_block(w[i, r, 32 * b : 32 * b + 32].tolist(), "e2m1", "ceil")
                codes[i][r] += c
                scales[i][r].append(byte)
    cc, ss = ref_clamp(codes, scales, 11)
    return torch.tensor(
        [
            [
                [decode_e2m1(c) * 2.0 ** (ss[i][r][j // 32] - 127) for j, c in enumerate(cc[i][r])]
                for r in range(n)
            ]
            for i in range(e)
        ]
    )


def test_recipe_payload_and_fc2_input_are_the_kernel_rules() -> None:
    from moe_ep.backends.portable.recipes import Fp8Mxfp4Recipe

    recipe = Fp8Mxfp4Recipe()
    x = _activations(8, 256, seed=5).bfloat16()
    payload = recipe.pack(x)
    assert payload.shape == (8, recipe.row_bytes(256)) == (8, 260)
    for r in range(8):
        codes, s = ref_per_token(x[r].float().tolist())
        assert payload[r, :256].tolist() == codes
        assert float(payload[r, 256:].view(torch.float32)) == s
    back = recipe.unpack(payload, 256)
    assert torch.equal(back, q.dequantize_fp8_per_row(*q.quantize_fp8_per_token_hybrid(x)))
    h = torch.cat([_near_midpoints(4, seed=6), _activations(4, 64, seed=7)]).repeat(1, 2)
    want = []
    for r in range(h.shape[0]):
        row = []
        for b in range(2):
            codes, s = ref_fc2_block(h[r, 64 * b : 64 * b + 64].tolist())
            row += [decode_e4m3(c) * s for c in codes]
        want.append(row)
    assert torch.equal(recipe.requantize(h).float(), torch.tensor(want, dtype=torch.float32))


def test_recipe_weights_from_bf16_and_from_a_prequantized_pack() -> None:
    from moe_ep.backends.portable.recipes import Fp8Mxfp4Recipe
    from moe_ep.types import MoEWeightPack

    # the recipe prepares each leg on its own: two [E, N, K] planes of wide exponents
    w13, w2 = _weights_with_wide_exponents(seed=8), _weights_with_wide_exponents(seed=9)
    w13_ref, w2_ref = _ref_weight(w13), _ref_weight(w2)
    prepared = Fp8Mxfp4Recipe().prepare(MoEWeightPack(w13=w13, w2=w2))
    assert torch.equal(prepared.w13t.transpose(1, 2), w13_ref)
    assert torch.equal(prepared.w2t.transpose(1, 2), w2_ref)
    p13, s13 = q.quantize_mxfp4(w13)
    p2, s2 = q.quantize_mxfp4(w2)
    pre = Fp8Mxfp4Recipe().prepare(MoEWeightPack(w13=p13, w2=p2, w13_scale=s13, w2_scale=s2))
    assert torch.equal(pre.w13t, prepared.w13t) and torch.equal(pre.w2t, prepared.w2t)
    assert not torch.equal(prepared.w13t.transpose(1, 2), q.dequantize_mxfp4(p13, s13))


def test_recipe_refuses_dims_off_128_and_nan_scales() -> None:
    from moe_ep.backends.portable.recipes import Fp8Mxfp4Recipe
    from moe_ep.types import MoEWeightPack

    recipe = Fp8Mxfp4Recipe()
    with pytest.raises(MoeEpUsageError, match="multiples of 128"):
        recipe.check_dims(256, 64)
    p, s = q.quantize_mxfp4(torch.randn(1, 256, 128))
    p2, s2 = q.quantize_mxfp4(torch.randn(1, 128, 128))
    s = s.clone()
    s[0, 3, 1] = 255
    with pytest.raises(MoeEpUsageError, match="w13_scale holds E8M0 byte 255"):
        recipe.check_scales(MoEWeightPack(w13=p, w2=p2, w13_scale=s, w2_scale=s2))

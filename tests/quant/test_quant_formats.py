"""Each quantizer against the scalar reference (bit-exact), and hypothesis properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from quant_ref import (
    FP32_MAX,
    decode_e2m1,
    decode_e4m3,
    decode_e5m2,
    fmt_max,
    fp8_block,
    fp8_fp32_scale,
    mx_block,
    nvfp4_block,
    nvfp4_global_scale,
    pack_nibbles,
)

import moe_ep.quant as q

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MANTISSA_BITS = {"e4m3": 3, "e5m2": 2, "e2m1": 1}
MIN_SUBNORMAL = {"e4m3": 2.0**-9, "e5m2": 2.0**-16, "e2m1": 0.5}
SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def blocks(draw: st.DrawFn, rows: int = 2, k: int = 64) -> torch.Tensor:
    """[rows, k] float32: per row a scale 2**exp and a kind (plain, zeros, one huge outlier,
    per-element exponents down to fp32 subnormals); bulk values come from a drawn seed."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    out = torch.empty(rows, k, dtype=torch.float64)
    for r in range(rows):
        exp = draw(st.integers(-140, 120))
        kind = draw(st.sampled_from(["normal", "zeros", "outlier", "mixed"]))
        mant = torch.rand(k, generator=g, dtype=torch.float64) * 2 - 1
        if kind == "zeros":
            out[r] = 0.0
        elif kind == "mixed":
            exps = torch.randint(-149, 101, (k,), generator=g)
            out[r] = torch.ldexp(mant, exps.double())
        else:
            out[r] = torch.ldexp(mant, torch.tensor(float(exp), dtype=torch.float64))
            if kind == "outlier":
                pos = draw(st.integers(0, k - 1))
                out[r, pos] = math.ldexp(draw(st.sampled_from([1.0, -1.0])), exp + 60)
    # Below 2**127: near fp32 max, e2m1 * 2**126 can round to 2**128 (see docs/quant.md).
    return out.clamp(-1e38, 1e38).float()


def _codes_fp8(t: torch.Tensor) -> list[list[int]]:
    return t.view(torch.uint8).tolist()


# ---------------------------------------------------------------- bit-exact vs reference


@SETTINGS
@given(x=blocks(), fmt=st.sampled_from(["e4m3", "e5m2"]), rule=st.sampled_from(["ceil", "ocp"]))
def test_mxfp8_matches_reference(x: torch.Tensor, fmt: str, rule: str) -> None:
    data, scales = q.quantize_mxfp8(x, dtype=FP8[fmt], rule=rule)
    for r, row in enumerate(x.tolist()):
        for b in range(0, len(row), 32):
            codes, byte = mx_block(row[b : b + 32], fmt, rule)
            assert _codes_fp8(data)[r][b : b + 32] == codes
            assert scales[r, b // 32].item() == byte


@SETTINGS
@given(x=blocks(), rule=st.sampled_from(["ceil", "ocp"]))
def test_mxfp4_matches_reference(x: torch.Tensor, rule: str) -> None:
    packed, scales = q.quantize_mxfp4(x, rule=rule)
    for r, row in enumerate(x.tolist()):
        want_codes: list[int] = []
        for b in range(0, len(row), 32):
            codes, byte = mx_block(row[b : b + 32], "e2m1", rule)
            want_codes += codes
            assert scales[r, b // 32].item() == byte
        assert packed[r].tolist() == pack_nibbles(want_codes)


@SETTINGS
@given(
    x=blocks(),
    norm_const=st.sampled_from([1.0, 0.5, 3.0, 1234.5, 2.0**-20, 7.25e9]),
)
def test_nvfp4_matches_reference(x: torch.Tensor, norm_const: float) -> None:
    packed, scales = q.quantize_nvfp4(x, norm_const=norm_const)
    for r, row in enumerate(x.tolist()):
        want_codes: list[int] = []
        for b in range(0, len(row), 16):
            codes, s_code = nvfp4_block(row[b : b + 16], norm_const)
            want_codes += codes
            assert scales[r, b // 16 : b // 16 + 1].view(torch.uint8).item() == s_code
        assert packed[r].tolist() == pack_nibbles(want_codes)


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_nvfp4_zero_blocks_get_scale_byte_zero(rows: int) -> None:
    # +0 and -0 in any mix and row count (the vectorised and scalar reductions differ in
    # which zero `maximum` keeps): the scale is +0 (byte 0x00, never -0 = 0x80), as the
    # reference's amax of |v|; payloads keep each zero's sign (v * 0).
    for neg in (slice(None), slice(0, None, 2), slice(1, None, 2)):
        x = torch.zeros(rows, 32)
        x[:, neg] = -0.0
        for xx in (x, x.bfloat16()):
            for nc in (1.0, 3.0):
                packed, scales = q.quantize_nvfp4(xx, norm_const=nc)
                assert scales.view(torch.uint8).eq(0).all(), (neg, xx.dtype, nc)
                codes, s_code = nvfp4_block(x[0, :16].tolist(), nc)
                assert s_code == 0
                assert packed[0, :8].tolist() == pack_nibbles(codes)


def test_nvfp4_global_scale_is_2688_times_the_reciprocal() -> None:
    # The kernels' rule (docs/quant.md): fp32(2688 * fp32(1 / amax)), not the correctly
    # rounded quotient. Every positive finite bf16 amax (what bf16 weights have), plus
    # fp32 ones, against the scalar reference.
    bf16 = torch.arange(1, 0x7F80, dtype=torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(7)
    fp32 = torch.ldexp(torch.rand(4096, generator=g) + 0.5, torch.randint(-140, 120, (4096,)))
    amax = torch.cat([bf16, fp32]).unsqueeze(-1)
    got = q.nvfp4_global_scale(amax, dim=-1).squeeze(-1).tolist()
    assert got == [nvfp4_global_scale(a) for a in amax.squeeze(-1).tolist()]
    assert float(q.nvfp4_global_scale(torch.tensor([0.109375, -0.1]))) == 24576.001953125
    # The two rules differ often enough to matter (exact e2m1 ties move):
    quotient = (2688.0 / amax.double()).float().clamp_max(2.0**126).squeeze(-1)
    assert (torch.tensor(got) != quotient).float().mean() > 0.1


def test_nvfp4_bf16_weights_with_a_global_scale_match_the_reference() -> None:
    # Per-expert global scales (not 1): every scale byte and code equals the reference's
    # single rounding of v * (nc * (1 / scale)); the double rounding fl(fl(v * nc) / scale)
    # this replaced got 51 of these 32,768 codes wrong (how many depends on nc).
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(2, 64, 256, generator=g) * 0.05).to(torch.bfloat16)
    nc = q.nvfp4_global_scale(w, dim=(-2, -1))
    packed, scales = q.quantize_nvfp4(w, norm_const=nc)
    for e in range(2):
        assert float(nc[e]) != 1.0
        for r, row in enumerate(w[e].float().tolist()):
            want_codes: list[int] = []
            for b in range(0, 256, 16):
                codes, s_code = nvfp4_block(row[b : b + 16], float(nc[e]))
                want_codes += codes
                assert scales[e, r, b // 16].view(torch.uint8).item() == s_code
            assert packed[e, r].tolist() == pack_nibbles(want_codes), (e, r)


@SETTINGS
@given(
    x=blocks(rows=3, k=256),
    fmt=st.sampled_from(["e4m3", "e5m2"]),
    scale_format=st.sampled_from(["fp32", "ue8m0"]),
)
def test_fp8_blockwise_1x128_matches_reference(
    x: torch.Tensor, fmt: str, scale_format: str
) -> None:
    data, scales = q.quantize_fp8_blockwise(x, dtype=FP8[fmt], scale_format=scale_format)
    assert scales.shape == (3, 2)
    for r, row in enumerate(x.tolist()):
        for b in range(2):
            codes, scale = fp8_block(row[b * 128 : (b + 1) * 128], fmt, scale_format)
            assert _codes_fp8(data)[r][b * 128 : (b + 1) * 128] == codes
            assert scales[r, b].item() == scale


@pytest.mark.parametrize("scale_format", ["fp32", "ue8m0"])
def test_fp8_blockwise_128x128_matches_reference(scale_format: str) -> None:
    g = torch.Generator().manual_seed(1)
    # Two experts, ragged N = 140 (a partial second row block of 12 rows), K = 256.
    x = torch.randn(2, 140, 256, generator=g) * torch.logspace(-3, 3, 140).view(1, 140, 1)
    x[1, 128:] = 0.0  # the partial block of expert 1 is all zero
    data, scales = q.quantize_fp8_blockwise(x, block=(128, 128), scale_format=scale_format)
    assert data.shape == x.shape and scales.shape == (2, 2, 2)
    codes = data.view(torch.uint8)
    for e in range(2):
        for nb in range(2):
            for kb in range(2):
                rows, cols = slice(nb * 128, (nb + 1) * 128), slice(kb * 128, (kb + 1) * 128)
                want, scale = fp8_block(x[e, rows, cols].flatten().tolist(), "e4m3", scale_format)
                assert codes[e, rows, cols].flatten().tolist() == want
                assert scales[e, nb, kb].item() == scale
    deq = q.dequantize_fp8_blockwise(data, scales, block=(128, 128))
    assert deq.shape == x.shape and torch.equal(deq[1, 128:], torch.zeros(12, 256))


@SETTINGS
@given(x=blocks(rows=4, k=32), fmt=st.sampled_from(["e4m3", "e5m2"]))
def test_fp8_per_tensor_and_per_row_match_reference(x: torch.Tensor, fmt: str) -> None:
    rows = x.tolist()
    data, scale = q.quantize_fp8_per_tensor(x, dtype=FP8[fmt])
    flat = [v for row in rows for v in row]
    want, want_scale = fp8_block(flat, fmt, "fp32")
    assert data.view(torch.uint8).flatten().tolist() == want and scale.item() == want_scale
    data_r, scales_r = q.quantize_fp8_per_row(x, dtype=FP8[fmt])
    assert scales_r.shape == (4, 1)
    for r, row in enumerate(rows):
        want_r, s = fp8_block(row, fmt, "fp32")
        assert _codes_fp8(data_r)[r] == want_r and scales_r[r, 0].item() == s


# ---------------------------------------------------------------- properties


def _bound(x: torch.Tensor, unit: torch.Tensor, fmt: str, fmax: float) -> torch.Tensor:
    """|deq - x| allowed per element: half an ulp at |x| (relative), half the smallest step,
    plus whatever lies beyond the saturation point fmax * unit, plus fp32 slack."""
    ax = x.abs()
    rel = ax * 2.0 ** -(MANTISSA_BITS[fmt] + 1)
    sub = unit * MIN_SUBNORMAL[fmt] / 2
    sat = (ax - fmax * unit).clamp_min(0)
    return rel + sub + sat + ax * 2.0**-20 + 1e-45


def _check_bound(x: torch.Tensor, deq: torch.Tensor, unit: torch.Tensor, fmt: str) -> None:
    err = (deq - x).abs()
    bound = _bound(x, unit, fmt, fmt_max(fmt))
    assert torch.isfinite(deq).all()
    bad = err > bound
    assert not bad.any(), (x[bad][:4], deq[bad][:4], bound[bad][:4])


@SETTINGS
@given(x=blocks(rows=3, k=128), fmt=st.sampled_from(["e4m3", "e5m2"]))
def test_round_trip_error_bound_fp8(x: torch.Tensor, fmt: str) -> None:
    for rule in ("ceil", "ocp"):
        d, s = q.quantize_mxfp8(x, dtype=FP8[fmt], rule=rule)
        unit = q.e8m0_to_float32(s).repeat_interleave(32, -1)
        _check_bound(x, q.dequantize_mxfp8(d, s), unit, fmt)
        if rule == "ceil":  # the ceil rule never saturates
            assert (x.abs() <= fmt_max(fmt) * unit).all()
    for scale_format in ("fp32", "ue8m0"):
        d, s = q.quantize_fp8_blockwise(x, dtype=FP8[fmt], scale_format=scale_format)
        unit = s.repeat_interleave(128, -1)
        _check_bound(x, q.dequantize_fp8_blockwise(d, s), unit, fmt)
    d, s = q.quantize_fp8_per_row(x, dtype=FP8[fmt])
    _check_bound(x, q.dequantize_fp8_per_row(d, s), s.expand_as(x), fmt)
    d, s = q.quantize_fp8_per_tensor(x, dtype=FP8[fmt])
    _check_bound(x, q.dequantize_fp8_per_tensor(d, s), s.expand_as(x), fmt)


@SETTINGS
@given(x=blocks(rows=3, k=64))
def test_round_trip_error_bound_fp4(x: torch.Tensor) -> None:
    for rule in ("ceil", "ocp"):
        p, s = q.quantize_mxfp4(x, rule=rule)
        unit = q.e8m0_to_float32(s).repeat_interleave(32, -1)
        _check_bound(x, q.dequantize_mxfp4(p, s), unit, "e2m1")
    # nvfp4 with the global scale: unit = e4m3 scale / norm_const; the e4m3 rounding of the
    # scale may push amax / scale above 6, which the saturation term covers.
    nc = q.nvfp4_global_scale(x)
    p, s = q.quantize_nvfp4(x, norm_const=nc)
    unit = (s.float() / nc).repeat_interleave(16, -1)
    deq = q.dequantize_nvfp4(p, s, norm_const=nc)
    # Blocks whose scale underflows e4m3 store zeros: the error is the block's own values.
    zero_scale = (s.float() == 0).repeat_interleave(16, -1)
    # Blocks whose payload multiplier nc / scale passes FLT_MAX have it capped there, as the
    # kernels' fmin does (nc itself capped at 2**126: a tensor of fp32-subnormal amax): their
    # elements are scaled by less than the bound assumes, so the scalar reference, which
    # states the cap, checks them instead.
    sf = s.float().double()
    capped = (sf > 0) & (float(nc) / sf > FP32_MAX)
    keep = ~zero_scale & ~capped.repeat_interleave(16, -1)
    _check_bound(x[keep], deq[keep], unit[keep], "e2m1")
    codes = q.unpack_e2m1(p)
    for r, b in capped.nonzero().tolist():
        want, s_code = nvfp4_block(x[r, 16 * b : 16 * b + 16].tolist(), float(nc))
        assert int(s[r, b].view(torch.uint8)) == s_code
        assert codes[r, 16 * b : 16 * b + 16].tolist() == want
    assert (deq[zero_scale] == 0).all()
    # ... and those are exactly the blocks whose scaled amax is below half the smallest e4m3
    # subnormal (2**-10), computed here in float64.
    amax16 = x.double().abs().view(3, 4, 16).amax(-1)
    below = amax16 / 6 * nc.double() <= 2.0**-10
    assert torch.equal(below, s.float() == 0)


def _representable(fmt: str, g: torch.Generator, n: int) -> list[float]:
    decode = {"e4m3": decode_e4m3, "e5m2": decode_e5m2, "e2m1": decode_e2m1}[fmt]
    ncodes = 16 if fmt == "e2m1" else 256
    codes = torch.randint(0, ncodes, (n,), generator=g).tolist()
    vals = [decode(c) for c in codes]
    return [v if math.isfinite(v) else 0.0 for v in vals]


@pytest.mark.parametrize("seed", range(3))
def test_idempotent_on_representable_values(seed: int) -> None:
    # Blocks of element-grid values with one +-max, times a power of two: every format must
    # reproduce them exactly, and quantizing its own output again changes nothing.
    g = torch.Generator().manual_seed(seed)
    k2 = [2.0**e for e in (-30, -3, 0, 7, 40)]
    for fmt in ("e4m3", "e5m2"):
        fm = fmt_max(fmt)
        rows = []
        for i in range(5):
            vals = _representable(fmt, g, 128)
            vals[i * 3] = fm if i % 2 else -fm
            rows.append([v * k2[i] for v in vals])
        x = torch.tensor(rows, dtype=torch.float32)
        d, s = q.quantize_fp8_blockwise(x, dtype=FP8[fmt])
        assert torch.equal(q.dequantize_fp8_blockwise(d, s), x)
        d, s = q.quantize_fp8_per_row(x, dtype=FP8[fmt])
        assert torch.equal(q.dequantize_fp8_per_row(d, s), x)
        # mx: each 32-block needs its own max element.
        xm = x.view(-1, 32).clone()
        xm[:, 5] = fm * torch.tensor([k2[r // 4] for r in range(xm.shape[0])])
        for rule in ("ceil", "ocp"):
            d, s = q.quantize_mxfp8(xm, dtype=FP8[fmt], rule=rule)
            assert torch.equal(q.dequantize_mxfp8(d, s), xm), rule
        y = q.dequantize_mxfp8(*q.quantize_mxfp8(torch.randn(8, 64, generator=g), dtype=FP8[fmt]))
        assert torch.equal(q.dequantize_mxfp8(*q.quantize_mxfp8(y, dtype=FP8[fmt])), y)
    # e2m1 formats
    grid = torch.tensor(_representable("e2m1", g, 16 * 32)).view(32, 16)
    grid[:, 3] = 6.0
    s_e4m3 = torch.tensor([decode_e4m3(c) for c in range(1, 127, 4)][:32]).view(32, 1)
    x4 = (grid * s_e4m3).contiguous()
    p, s = q.quantize_nvfp4(x4)
    assert torch.equal(s.float(), s_e4m3) and torch.equal(q.dequantize_nvfp4(p, s), x4)
    xm4 = grid.view(16, 32) * torch.tensor([2.0**e for e in range(-8, 8)]).view(16, 1)
    xm4[:, 3] = 6.0 * torch.tensor([2.0**e for e in range(-8, 8)])
    p, s = q.quantize_mxfp4(xm4)
    assert torch.equal(q.dequantize_mxfp4(p, s), xm4)
    y = q.dequantize_mxfp4(*q.quantize_mxfp4(torch.randn(8, 64, generator=g)))
    assert torch.equal(q.dequantize_mxfp4(*q.quantize_mxfp4(y)), y)


def test_zeros_everywhere() -> None:
    x = torch.zeros(3, 128)
    d, s = q.quantize_mxfp8(x)
    assert s.flatten().tolist() == [0] * 12 and (d.float() == 0).all()
    p, s = q.quantize_mxfp4(x)
    assert s.flatten().tolist() == [0] * 12 and (p == 0).all()
    p, s = q.quantize_nvfp4(x)
    assert (s.float() == 0).all() and (p == 0).all()
    d, s = q.quantize_fp8_blockwise(x)
    assert (s == 1.0).all() and (d.float() == 0).all()
    d, s = q.quantize_fp8_blockwise(x, scale_format="ue8m0")
    assert q.float32_pow2_to_e8m0(s).flatten().tolist() == [0] * 3
    assert float(q.nvfp4_global_scale(x)) == 1.0


def test_empty_leading_dims_are_legal() -> None:
    x = torch.zeros(0, 256, dtype=torch.bfloat16)
    for fn in (q.quantize_mxfp8, q.quantize_mxfp4, q.quantize_nvfp4, q.quantize_fp8_blockwise):
        data, scales = fn(x)
        assert data.shape[0] == 0 and scales.shape[0] == 0
    d, s = q.quantize_fp8_per_tensor(x)
    assert d.shape == (0, 256) and s.item() == 1.0


def test_subnormal_inputs() -> None:
    x = torch.tensor([[1e-45, -3e-42, 2e-39, 0.0] * 8], dtype=torch.float32)
    for fmt in ("e4m3", "e5m2"):
        d, s = q.quantize_mxfp8(x, dtype=FP8[fmt])
        _check_bound(x, q.dequantize_mxfp8(d, s), q.e8m0_to_float32(s).repeat_interleave(32), fmt)
        d, s = q.quantize_fp8_per_tensor(x, dtype=FP8[fmt])
        assert s.item() == fp8_fp32_scale(x.abs().max().item(), fmt_max(fmt))
        assert torch.isfinite(q.dequantize_fp8_per_tensor(d, s)).all()
    p, s = q.quantize_mxfp4(x)
    _check_bound(x, q.dequantize_mxfp4(p, s), q.e8m0_to_float32(s).repeat_interleave(32), "e2m1")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_just_above_max_saturates_never_inf(fmt: str) -> None:
    fm = fmt_max(fmt)
    top = 2.0 ** ({"e4m3": 8, "e5m2": 15}[fmt] + 1)
    over = [fm * (1 + 2.0**-20), fm * 1.1, top * (1 - 2.0**-10)]
    # OCP rule: amax in (fmax, 2**(emax+1)) keeps scale 1 (byte 127), so these saturate.
    x = torch.tensor([over + [-v for v in over] + [1.0] * 26])
    d, s = q.quantize_mxfp8(x, dtype=FP8[fmt], rule="ocp")
    assert s.tolist() == [[127]]
    assert d.float()[0, :6].tolist() == [fm] * 3 + [-fm] * 3
    # e5m2: torch's own cast of 1.1 * max is inf; ours saturates first.
    t = torch.tensor([fm * 1.1])
    if fmt == "e5m2":
        assert torch.isinf(t.to(torch.float8_e5m2).float()).all()
    for fn in (q.quantize_fp8_per_tensor, q.quantize_fp8_per_row, q.quantize_fp8_blockwise):
        xx = torch.full((1, 128), fm * 1.1)
        dd, _ = fn(xx, dtype=FP8[fmt])
        assert (dd.float() == fm).all()


def test_one_huge_outlier_per_block() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 128, generator=g) * 1e-3
    x[:, ::32] = 1e30
    for fmt in ("e4m3", "e5m2"):
        d, s = q.quantize_mxfp8(x, dtype=FP8[fmt])
        deq = q.dequantize_mxfp8(d, s)
        _check_bound(x, deq, q.e8m0_to_float32(s).repeat_interleave(32, -1), fmt)
    nc = q.nvfp4_global_scale(x)
    p, s = q.quantize_nvfp4(x, norm_const=nc)
    deq = q.dequantize_nvfp4(p, s, norm_const=nc)
    rel = ((deq[:, ::32] - x[:, ::32]).abs() / x[:, ::32].abs()).max()
    assert rel < 2.0**-3


def test_bf16_and_fp16_inputs_match_float32() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 128, generator=g).bfloat16()
    for fn in (q.quantize_mxfp8, q.quantize_mxfp4, q.quantize_nvfp4, q.quantize_fp8_blockwise):
        for xx in (x, x.half()):
            a, sa = fn(xx)
            b, sb = fn(xx.float())
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            assert torch.equal(sa.view(torch.uint8), sb.view(torch.uint8))


def test_per_expert_norm_const_and_alpha() -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(3, 8, 32, generator=g) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    nc = q.nvfp4_global_scale(w, dim=(-2, -1))
    assert nc.shape == (3, 1, 1)
    assert torch.allclose(nc.flatten(), 2688.0 / w.abs().amax(dim=(1, 2)))
    p, s = q.quantize_nvfp4(w, norm_const=nc)
    for e in range(3):
        pe, se = q.quantize_nvfp4(w[e], norm_const=float(nc[e]))
        assert torch.equal(pe, p[e]) and torch.equal(se.view(torch.uint8), s[e].view(torch.uint8))
    # alpha path: dequantize without norm_const, multiply by 1/norm_const later.
    raw = q.dequantize_nvfp4(p, s)
    assert torch.allclose(raw / nc, q.dequantize_nvfp4(p, s, norm_const=nc), rtol=1e-6)
    assert q.nvfp4_alpha(2.0, 4.0) == 0.125


def test_e8m0_scale_dtype_option() -> None:
    x = torch.randn(2, 64)
    d, s = q.quantize_mxfp8(x, scale_dtype=torch.float8_e8m0fnu)
    assert s.dtype == torch.float8_e8m0fnu
    d2, s2 = q.quantize_mxfp8(x)
    assert torch.equal(s.view(torch.uint8), s2)
    assert torch.equal(q.dequantize_mxfp8(d, s), q.dequantize_mxfp8(d2, s2))
    p, s = q.quantize_mxfp4(x, scale_dtype=torch.float8_e8m0fnu)
    assert torch.equal(q.dequantize_mxfp4(p, s), q.dequantize_mxfp4(*q.quantize_mxfp4(x)))


def test_inputs_are_never_modified() -> None:
    # The quantizers work in place on a private float32 copy; a float32 input must survive.
    x = torch.randn(4, 256) * 3
    keep = x.clone()
    for fn in (
        q.quantize_fp8_per_tensor,
        q.quantize_fp8_per_row,
        q.quantize_fp8_blockwise,
        lambda t: q.quantize_fp8_blockwise(t, block=(128, 128)),
        q.quantize_mxfp8,
        q.quantize_mxfp4,
        q.quantize_nvfp4,
        lambda t: q.quantize_nvfp4(t, norm_const=q.nvfp4_global_scale(t)),
        q.round_to_e2m1_codes,
    ):
        fn(x)
        assert torch.equal(x, keep)

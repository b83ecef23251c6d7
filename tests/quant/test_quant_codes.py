"""Bit-exact checks over whole code spaces and every rounding midpoint, against quant_ref."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from quant_ref import (
    GRIDS,
    decode_e2m1,
    decode_e4m3,
    decode_e5m2,
    decode_e8m0,
    encode,
    fmt_max,
    midpoints,
)

import moe_ep.quant as q

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
REF_DECODE = {"e4m3": decode_e4m3, "e5m2": decode_e5m2}


def _same(a: float, b: float) -> bool:
    """Equal including the sign of zero; NaN equals NaN."""
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _next_up(v: float) -> float:
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    return float(struct.unpack("<f", struct.pack("<I", bits + 1))[0])


def _next_down(v: float) -> float:
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    return float(struct.unpack("<f", struct.pack("<I", bits - 1))[0])


def test_reference_grids_have_the_published_shape() -> None:
    # Format facts from the OCP / NVIDIA specs, checked against the reference decoders.
    assert fmt_max("e4m3") == 448.0 and fmt_max("e5m2") == 57344.0 and fmt_max("e2m1") == 6.0
    assert GRIDS["e2m1"][0] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert min(v for v in GRIDS["e4m3"][0] if v > 0) == 2.0**-9
    assert min(v for v in GRIDS["e5m2"][0] if v > 0) == 2.0**-16
    assert math.isnan(decode_e4m3(0x7F)) and decode_e4m3(0x7E) == 448.0
    assert decode_e5m2(0x7C) == math.inf and math.isnan(decode_e5m2(0x7D))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_all_256_fp8_codes_decode_like_the_reference(fmt: str) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    got = codes.view(FP8[fmt]).float().tolist()
    for c, g in enumerate(got):
        assert _same(g, REF_DECODE[fmt](c)), (fmt, c, g)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_all_finite_fp8_codes_round_trip_through_the_quantizer(fmt: str) -> None:
    # Rows of 31 codes plus the format max: the ceil-rule scale is exactly 1 (byte 127), so
    # each element must come back as its own code.
    finite = [c for c in range(256) if math.isfinite(REF_DECODE[fmt](c))]
    finite += [0] * ((-len(finite)) % 31)
    rows = [finite[i : i + 31] for i in range(0, len(finite), 31)]
    x = torch.tensor([[REF_DECODE[fmt](c) for c in r] + [fmt_max(fmt)] for r in rows])
    data, scales = q.quantize_mxfp8(x, dtype=FP8[fmt])
    assert data.view(torch.uint8)[:, :31].tolist() == rows
    assert scales.flatten().tolist() == [127] * len(rows)


def test_all_16_e2m1_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    decoded = q.e2m1_codes_to_float32(codes).tolist()
    for c, g in enumerate(decoded):
        assert _same(g, decode_e2m1(c)), (c, g)
    assert q.round_to_e2m1_codes(torch.tensor(decoded)).tolist() == list(range(16))
    # Packing: even element in the low nibble.
    packed = q.pack_e2m1(codes)
    assert packed.tolist() == [(2 * i) | ((2 * i + 1) << 4) for i in range(8)]
    assert torch.equal(q.unpack_e2m1(packed), codes)
    # Through the public quantizers: a block of all codes with max 6 has scale 1.
    x = torch.tensor([decode_e2m1(c) for c in range(16)] * 2)
    packed_mx, s_mx = q.quantize_mxfp4(x)
    assert q.unpack_e2m1(packed_mx).tolist() == list(range(16)) * 2 and s_mx.tolist() == [127]
    packed_nv, s_nv = q.quantize_nvfp4(x)
    assert q.unpack_e2m1(packed_nv).tolist() == list(range(16)) * 2
    assert s_nv.float().tolist() == [1.0, 1.0]


def test_all_256_e8m0_bytes() -> None:
    b = torch.arange(256, dtype=torch.uint8)
    for scales in (b, b.view(torch.float8_e8m0fnu)):
        got = q.e8m0_to_float32(scales).tolist()
        for byte, g in enumerate(got):
            assert _same(g, decode_e8m0(byte)), (byte, g)
    # Every finite byte decodes through the mxfp8 dequantizer to its power of two.
    ones = torch.full((255, 32), 1.0).to(torch.float8_e4m3fn)
    deq = q.dequantize_mxfp8(ones, b[:255].view(255, 1))
    assert deq[:, 0].tolist() == [decode_e8m0(i) for i in range(255)]
    # And back: powers of two map to their byte.
    pows = torch.tensor([decode_e8m0(i) for i in range(255)], dtype=torch.float32)
    assert q.float32_pow2_to_e8m0(pows).tolist() == list(range(255))


def _probe_values(fmt: str) -> list[float]:
    """Every midpoint, one fp32 ulp either side, every representable value, and beyond max."""
    out: list[float] = []
    for m in midpoints(fmt):
        out += [m, _next_down(m), _next_up(m)]
    out += GRIDS[fmt][0]
    mx = fmt_max(fmt)
    out += [_next_up(mx), mx * 1.0625, mx * 1.5]
    return out + [-v for v in out]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_rounding_at_every_midpoint(fmt: str) -> None:
    # Per-row fp32 scale with the row max equal to the format max is exactly 1, so the
    # elements are rounded as given. Rows are built so that amax == fmax.
    mx = fmt_max(fmt)
    probes = [v for v in _probe_values(fmt) if abs(v) <= mx]
    x = torch.tensor([[p, mx] for p in probes], dtype=torch.float32)
    data, scales = q.quantize_fp8_per_row(x, dtype=FP8[fmt])
    assert scales.flatten().tolist() == [1.0] * len(probes)
    got = data.view(torch.uint8)[:, 0].tolist()
    want = [encode(p, fmt) for p in probes]
    assert got == want


def test_e2m1_rounding_at_every_midpoint() -> None:
    probes = _probe_values("e2m1")
    want = [encode(p, "e2m1") for p in probes]
    got = q.round_to_e2m1_codes(torch.tensor(probes, dtype=torch.float32)).tolist()
    assert got == want
    # Ties to even, spelled out (code of the magnitude):
    ties = {0.25: 0, 0.75: 2, 1.25: 2, 1.75: 4, 2.5: 4, 3.5: 6, 5.0: 6}
    for v, c in ties.items():
        assert encode(v, "e2m1") == c
        assert q.round_to_e2m1_codes(torch.tensor([v])).item() == c


def test_nvfp4_elements_at_every_midpoint() -> None:
    # Blocks of 16 with amax 6 -> e4m3 scale 1.0, elements rounded as given.
    probes = [p for p in _probe_values("e2m1") if abs(p) <= 6.0]
    pad = (-len(probes)) % 15
    probes += [0.0] * pad
    rows = [[*probes[i : i + 15], 6.0] for i in range(0, len(probes), 15)]
    x = torch.tensor(rows, dtype=torch.float32)
    packed, scales = q.quantize_nvfp4(x)
    assert scales.float().flatten().tolist() == [1.0] * len(rows)
    got = q.unpack_e2m1(packed)[:, :15].flatten().tolist()
    assert got == [encode(p, "e2m1") for p in probes]

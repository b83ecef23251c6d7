"""Independent scalar reference for moe_ep.quant, in plain Python (no torch).

Written apart from the vectorised code on purpose: codes are decoded from their bit fields,
rounding picks the nearest representable value by exact rational comparison (ties to the
even code), exponents are found by exact search, and fp32 arithmetic is emulated by rounding
Python doubles through `struct` (a double quotient/product of two fp32 values rounds to the
correctly rounded fp32 result, since 53 >= 2 * 24 + 2).
"""

from __future__ import annotations

import bisect
import itertools
import math
import struct
from fractions import Fraction

NAN = float("nan")


def f32(v: float) -> float:
    """Round a double to the nearest fp32 (ties to even), as a double; overflow -> +-inf."""
    try:
        return float(struct.unpack("<f", struct.pack("<f", v))[0])
    except OverflowError:
        return math.copysign(math.inf, v)


# ---------------------------------------------------------------- decoding bit fields


def decode_e4m3(b: int) -> float:
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    if e == 0xF and m == 0x7:
        return NAN
    if e == 0:
        return sign * (m / 8) * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def decode_e5m2(b: int) -> float:
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 2) & 0x1F, b & 0x3
    if e == 0x1F:
        return sign * math.inf if m == 0 else NAN
    if e == 0:
        return sign * (m / 4) * 2.0**-14
    return sign * (1 + m / 4) * 2.0 ** (e - 15)


def decode_e2m1(c: int) -> float:
    sign = -1.0 if c & 0x8 else 1.0
    e, m = (c >> 1) & 0x3, c & 0x1
    if e == 0:
        return sign * m * 0.5
    return sign * (1 + m / 2) * 2.0 ** (e - 1)


def decode_e8m0(b: int) -> float:
    return NAN if b == 255 else 2.0 ** (b - 127)


DECODERS = {"e4m3": decode_e4m3, "e5m2": decode_e5m2, "e2m1": decode_e2m1}
CODE_BITS = {"e4m3": 8, "e5m2": 8, "e2m1": 4}
SIGN_BIT = {"e4m3": 0x80, "e5m2": 0x80, "e2m1": 0x8}


def _positive_grid(fmt: str) -> tuple[list[float], list[int]]:
    dec = DECODERS[fmt]
    pairs = sorted((dec(c), c) for c in range(1 << (CODE_BITS[fmt] - 1)) if math.isfinite(dec(c)))
    return [v for v, _ in pairs], [c for _, c in pairs]


GRIDS = {fmt: _positive_grid(fmt) for fmt in DECODERS}


def fmt_max(fmt: str) -> float:
    return GRIDS[fmt][0][-1]


def encode(v: float, fmt: str) -> int:
    """Round `v` to the nearest code of `fmt`, ties to the even code, saturating at +-max."""
    vals, codes = GRIDS[fmt]
    sign = SIGN_BIT[fmt] if math.copysign(1.0, v) < 0 else 0
    mag = abs(v)
    if mag >= vals[-1]:
        return sign | codes[-1]
    i = bisect.bisect_right(vals, mag)  # vals[i-1] <= mag < vals[i]
    lo, hi = vals[i - 1], vals[i]
    d_lo, d_hi = Fraction(mag) - Fraction(lo), Fraction(hi) - Fraction(mag)
    if d_lo < d_hi:
        pick = i - 1
    elif d_hi < d_lo:
        pick = i
    else:
        pick = i - 1 if codes[i - 1] % 2 == 0 else i
    return sign | codes[pick]


def midpoints(fmt: str) -> list[float]:
    """Every midpoint between consecutive non-negative representable values."""
    vals = GRIDS[fmt][0]
    return [(a + b) / 2 for a, b in itertools.pairwise(vals)]


# ---------------------------------------------------------------- exponents, exactly


def exact_floor_log2(a: float) -> int:
    fa = Fraction(a)
    e = math.frexp(a)[1]
    while Fraction(2) ** e > fa:
        e -= 1
    while Fraction(2) ** (e + 1) <= fa:
        e += 1
    return e


def exact_ceil_log2_ratio(a: float, fmax: float) -> int:
    """Smallest integer e with fmax * 2**e >= a."""
    fa, fm = Fraction(a), Fraction(fmax)
    e = exact_floor_log2(a) - exact_floor_log2(fmax)
    while fm * Fraction(2) ** e < fa:
        e += 1
    while fm * Fraction(2) ** (e - 1) >= fa:
        e -= 1
    return e


EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}


# ---------------------------------------------------------------- block quantizers


def mx_block(vals: list[float], fmt: str, rule: str) -> tuple[list[int], int]:
    """One 32-element block -> (element codes, E8M0 byte)."""
    amax = max(abs(v) for v in vals)
    if amax == 0:
        return [encode(v, fmt) for v in vals], 0
    if rule == "ceil":
        e = exact_ceil_log2_ratio(amax, fmt_max(fmt))
    else:
        e = exact_floor_log2(amax) - EMAX[fmt]
    e = max(-127, min(127, e))
    return [encode(f32(v * 2.0**-e), fmt) for v in vals], e + 127


def fp8_fp32_scale(amax: float, fmax: float) -> float:
    if amax == 0:
        return 1.0
    return max(f32(amax / fmax), 2.0**-126)


def fp8_ue8m0_scale(amax: float, fmax: float) -> float:
    if amax == 0:
        return 2.0**-127
    return 2.0 ** max(-127, min(127, exact_ceil_log2_ratio(amax, fmax)))


def fp8_block(vals: list[float], fmt: str, scale_format: str) -> tuple[list[int], float]:
    """One fp8 block (any size) -> (element codes, fp32 scale)."""
    fmax = fmt_max(fmt)
    amax = max(abs(v) for v in vals)
    scale = fp8_fp32_scale(amax, fmax) if scale_format == "fp32" else fp8_ue8m0_scale(amax, fmax)
    return [encode(f32(v / scale), fmt) for v in vals], scale


FP32_MAX = float.fromhex("0x1.fffffep+127")
RCP_6 = f32(1.0 / 6.0)  # the kernels' Nvfp4E2M1RcpLimit, an fp32 constant


def nvfp4_global_scale(amax: float) -> float:
    """norm_const of a tensor with amax `amax`: fp32 2688 * fp32(1 / amax), as the sm100 drop's
    kernel computes it (reciprocal, then multiply); 1.0 for 0, at most 2**126."""
    if amax == 0:
        return 1.0
    return min(f32(2688.0 * f32(1.0 / amax)), 2.0**126)


def nvfp4_block(vals: list[float], norm_const: float = 1.0) -> tuple[list[int], int]:
    """One 16-element block -> (e2m1 codes, e4m3 scale byte), as the sm100 drop computes it:
    scale = e4m3(min(amax * fp32(1/6) * nc, 448)); acc = min(nc * (1 / scale), FP32_MAX),
    0 for a zero scale; code = RNE_e2m1(v * acc); every step one fp32 rounding."""
    nc = f32(norm_const)
    amax = max(abs(v) for v in vals)
    s = min(f32(f32(amax * RCP_6) * nc), 448.0)
    s_code = encode(s, "e4m3")
    sf = decode_e4m3(s_code)
    acc = 0.0 if sf == 0 else min(f32(nc * f32(1.0 / sf)), FP32_MAX)
    return [encode(f32(v * acc), "e2m1") for v in vals], s_code


def pack_nibbles(codes: list[int]) -> list[int]:
    return [codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)]


# ---------------------------------------------------------------- 128x4 swizzle offsets


def swizzle_offset(r: int, c: int, cols: int) -> int:
    """Offset of scale (r, c) in the swizzled plane (cuBLAS 1D block-scaling layout)."""
    col_tiles = -(-cols // 4)
    tile = (r // 128) * col_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4

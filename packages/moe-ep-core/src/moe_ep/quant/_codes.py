"""Element and scale code helpers shared by every format: fp8 limits, E8M0, e2m1.

The e2m1 code (4 bits): sign in bit 3, then 2 exponent bits and 1 mantissa bit; magnitudes by
code 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6. torch has no cast to or from e2m1
(`float4_e2m1fn_x2` is storage only), so rounding and packing are done here by hand.

E8M0 (one byte, no sign, no mantissa): byte b encodes 2**(b - 127); 255 is NaN. torch calls
this dtype `float8_e8m0fnu`; here scale planes are uint8 unless asked otherwise.
"""

from __future__ import annotations

import math

import torch

from moe_ep.errors import MoeEpUsageError

# Largest finite value of each fp8 element dtype.
FP8_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}
# Exponent of the largest power of two at or below the format max (the OCP "emax_elem").
FP8_EMAX: dict[torch.dtype, int] = {
    torch.float8_e4m3fn: 8,
    torch.float8_e5m2: 15,
}
E2M1_MAX = 6.0
E2M1_EMAX = 2

E8M0_BIAS = 127
E8M0_NAN = 255

# Magnitudes of e2m1 codes 0..7.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_ONE_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)


def fp8_dtype_info(dtype: torch.dtype, *, arg: str = "dtype") -> tuple[float, int]:
    """(finite max, emax) of an fp8 element dtype; `MoeEpUsageError` for anything else."""
    if dtype not in FP8_MAX:
        raise MoeEpUsageError(
            f"{arg} must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
        )
    return FP8_MAX[dtype], FP8_EMAX[dtype]


def owned_float32(x: torch.Tensor) -> torch.Tensor:
    """A float32 copy of `x` that the quantizer may overwrite (in-place ops avoid allocating,
    and on CPU a fresh large allocation costs about as much as the arithmetic)."""
    return x.to(torch.float32, copy=True)


def abs_max(xv: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """amax of |xv| over `dim` (kept) without writing |xv|; NaN and inf propagate.

    A block of zeros gives +0: `maximum` of a +0 and a -0 (e.g. `-amin` of an all +0 block,
    or `amax` of an all -0 one) may return either sign, which a scale cast would keep (e4m3
    byte 0x80), so the result's sign is cleared (only the reduced tensor is touched).
    """
    return torch.maximum(xv.amax(dim, keepdim=True), xv.amin(dim, keepdim=True).neg_()).abs_()


def block_amax(xv: torch.Tensor) -> torch.Tensor:
    """amax of |xv| over the last dim, kept as size 1; zeros when xv is empty."""
    if xv.numel() == 0:
        return xv.new_zeros((*xv.shape[:-1], 1))
    return abs_max(xv, -1)


def exact_ceil_log2_ratio(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """ceil(log2(amax / fmax)) computed exactly (no rounded division), int32.

    With amax = m * 2**E and fmax = f * 2**F (m, f in [0.5, 1)), the quotient's exponent is
    E - F plus one when m > f. Only defined for amax > 0; callers mask the zero blocks.
    """
    m, e = torch.frexp(amax.float())
    f_m, f_e = math.frexp(fmax)
    return (e - f_e + (m > f_m).to(torch.int32)).to(torch.int32)


def floor_log2(amax: torch.Tensor) -> torch.Tensor:
    """floor(log2(amax)) for amax > 0, exact (fp32 subnormals included), int32."""
    _, e = torch.frexp(amax.float())
    return (e - 1).to(torch.int32)


def e8m0_exponent_to_bytes(exp: torch.Tensor, zero_block: torch.Tensor) -> torch.Tensor:
    """Clamp an unbiased exponent to E8M0's finite range and bias it; zero blocks -> byte 0."""
    biased = (exp + E8M0_BIAS).clamp(0, 254)
    return torch.where(zero_block, torch.zeros_like(biased), biased).to(torch.uint8)


def e8m0_to_float32(scales: torch.Tensor, *, arg: str = "scales") -> torch.Tensor:
    """Decode E8M0 bytes (uint8 or float8_e8m0fnu) to exact float32 powers of two.

    Byte 0 is 2**-127 (an fp32 subnormal), byte 255 is NaN.
    """
    if scales.dtype not in _ONE_SCALE_DTYPES:
        raise MoeEpUsageError(
            f"{arg} must be uint8 or torch.float8_e8m0fnu E8M0 bytes, got {scales.dtype}"
        )
    b = scales.view(torch.uint8).to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == E8M0_NAN, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def pow2_from_exponent(exp: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**exp for int exponents in [-127, 127] (bit construction, no exp2)."""
    biased = exp.to(torch.int32) + E8M0_BIAS
    bits = torch.where(biased <= 0, torch.full_like(biased, 0x00400000), biased << 23)
    return bits.view(torch.float32)


def as_scale_dtype(bytes_: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """Return E8M0 bytes as uint8 or reinterpreted as float8_e8m0fnu."""
    if scale_dtype not in _ONE_SCALE_DTYPES:
        raise MoeEpUsageError(
            f"scale_dtype must be torch.uint8 or torch.float8_e8m0fnu, got {scale_dtype}"
        )
    return bytes_ if scale_dtype == torch.uint8 else bytes_.view(torch.float8_e8m0fnu)


# e2m1 is e4m3 with the two low mantissa bits zero and the exponent bias moved by 6: the e2m1
# value of code c, times 2**-6, is the e4m3 value of byte 4 * c (subnormal 0.5 included).
E2M1_TO_E4M3_SHIFT = 2.0**-6
_BIASED_EXP_1 = (127 - 6) << 23  # fp32 exponent field of 1.0 * 2**-6
_BIASED_EXP_4 = (127 - 6 + 2) << 23  # ... of 4.0 * 2**-6


def e2m1_codes_from_shifted(y: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8) of float32 `y = v * 2**-6`: RNE on |v|, saturating at 6.

    The caller folds the 2**-6 into its own scaling (exact: a power of two). `y` is consumed
    (overwritten). Rounding: adding and subtracting C = 2**(e+22), with e the exponent of |y|
    clamped to the e2m1 bands [1, 2), [2, 4), [4, 8), rounds |y| to the band's e2m1 step with
    IEEE ties-to-even (the subnormal step 0.5 reuses the [1, 2) band); the exact result is then
    encoded by torch's e4m3 cast and shifted down.
    """
    sign = torch.signbit(y).view(torch.uint8)
    mag = y.abs_()
    c = (mag.view(torch.int32) & 0x7F800000).clamp_(_BIASED_EXP_1, _BIASED_EXP_4)
    c = c.add_(22 << 23).view(torch.float32)
    rounded = mag.add_(c).sub_(c)
    code = rounded.to(torch.float8_e4m3fn).view(torch.uint8)
    # > 6 rounds to 8 (byte 0x20) or, far out of range, casts to 0x7E / 0x7F: all clamp to 7.
    code = code.bitwise_right_shift_(2).clamp_max_(7)
    return code.add_(sign.bitwise_left_shift_(3))


def round_to_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values to e2m1 codes (uint8, 0..15): RNE on magnitudes, saturate at 6.

    The sign bit follows `signbit(v)`, so -0.0 and negatives that round to zero give code 8.
    """
    return e2m1_codes_from_shifted(v.float() * E2M1_TO_E4M3_SHIFT)


def e2m1_codes_to_float32(codes: torch.Tensor) -> torch.Tensor:
    """Decode e2m1 codes (uint8 0..15, one per element) to float32."""
    table = torch.tensor(
        [*E2M1_VALUES, *(-x for x in E2M1_VALUES)], dtype=torch.float32, device=codes.device
    )
    return table[codes.to(torch.int64)]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., K] (K even) two per byte, even element in the low nibble -> [..., K/2]."""
    pairs = codes.view(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return (pairs[..., 1] << 4).bitwise_or_(pairs[..., 0])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_e2m1`: [..., K/2] uint8 -> codes [..., K] uint8."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).view(*packed.shape[:-1], packed.shape[-1] * 2)

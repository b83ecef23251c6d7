"""OCP microscaling formats: mxfp8 (e4m3 / e5m2 elements) and mxfp4 (e2m1), 32-blocks, E8M0.

A block of 32 elements along K shares one E8M0 scale byte b = e + 127, X = 2**e, and
x ~= element * X. Two exponent rules, chosen with `rule=`:

- `"ocp"` (OCP MX v1.0, section 6.3): e = floor(log2(amax)) - emax_elem, with emax_elem = 8
  (e4m3), 15 (e5m2), 2 (e2m1). amax / X lies in [2**emax, 2**(emax+1)), which can exceed the
  element max (448, 57344, 6): those elements saturate to +-fmax.
- `"ceil"` (DeepGEMM, the block-scaled GPU kernels): e = ceil(log2(amax / fmax)), computed
  exactly from the fp32 amax. amax / X <= fmax, so nothing saturates.

Both: an all-zero block gets byte 0; e is clamped to [-127, 127]. Elements are x * 2**-e
(exact in fp32), clamped to +-fmax, then rounded to nearest even (fp8: torch cast; e2m1:
`round_to_e2m1_codes`). `normal_scales=True` floors e at -126 (every scale a normal fp32;
an all-zero block gets byte 1), as the sm100 MXFP4 x MXFP8 kernel's activation staging
(`mxfp8_normal_scales`) and its host weight quantizer do (docs/quant.md). With
`check_finite=False`, a block holding NaN / inf gets byte 255 (NaN) and NaN elements (fp8;
e2m1 has no NaN code), `moe_ep.quant.nonfinite`.

mxfp4 defaults to the ceil rule: with e2m1, fmax = 6 = 1.5 * 2**2, so the OCP rule clips
every element above 6 * X (up to a quarter of the block max is lost on the largest element),
while ceil never clips; it is also how DeepGEMM and triton quantize fp4 weights.
"""

from __future__ import annotations

import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep.quant._codes import (
    E2M1_EMAX,
    E2M1_MAX,
    E2M1_TO_E4M3_SHIFT,
    E8M0_NAN,
    as_scale_dtype,
    block_amax,
    e2m1_codes_from_shifted,
    e2m1_codes_to_float32,
    e8m0_exponent_to_bytes,
    e8m0_to_float32,
    exact_ceil_log2_ratio,
    floor_log2,
    fp8_dtype_info,
    owned_float32,
    pack_e2m1,
    pow2_from_exponent,
    unpack_e2m1,
)
from moe_ep.quant._validate import (
    check_block_divides,
    check_contiguous,
    check_dtype,
    check_finite_amax,
    check_high_precision,
    check_shape,
)
from moe_ep.quant.nonfinite import nan_scale_unless_finite

__all__ = [
    "MX_BLOCK",
    "MX_RULES",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "mx_block_exponents",
    "quantize_mxfp4",
    "quantize_mxfp8",
]

MX_BLOCK = 32
MX_RULES = ("ceil", "ocp")
_NORMAL_MIN_EXP = -126  # the smallest normal fp32 exponent


def mx_block_exponents(
    amax: torch.Tensor, *, fmax: float, emax: int, rule: str, normal_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared exponents of blocks with the given amax -> (int32 e in [-127, 127], E8M0 bytes).

    All-zero blocks get e = 0 (elements are zero anyway) and byte 0; non-finite blocks (NaN
    or inf amax) get e = 0 and byte 255 (NaN). `normal_scales`: e at least -126, all-zero
    blocks byte 1.
    """
    if rule == "ceil":
        exp = exact_ceil_log2_ratio(amax, fmax)
    elif rule == "ocp":
        exp = floor_log2(amax) - emax
    else:
        raise MoeEpUsageError(f"rule must be one of {MX_RULES}, got {rule!r}")
    if type(normal_scales) is not bool:
        raise MoeEpUsageError(f"normal_scales must be a bool, got {normal_scales!r}")
    zero = amax == 0
    finite = torch.isfinite(amax)
    lowest = _NORMAL_MIN_EXP if normal_scales else -127
    exp = torch.where(zero | ~finite, torch.zeros_like(exp), exp.clamp(lowest, 127))
    byte = e8m0_exponent_to_bytes(exp, zero)
    if normal_scales:
        byte = torch.where(zero, torch.full_like(byte, _NORMAL_MIN_EXP + 127), byte)
    return exp, torch.where(finite, byte, torch.full_like(byte, E8M0_NAN))


def _element_multiplier(exp: torch.Tensor, amax: torch.Tensor, shift: float = 1.0) -> torch.Tensor:
    """2**-e (times `shift`, a power of two) per block; NaN for non-finite blocks, so their
    elements become NaN (`moe_ep.quant.nonfinite`)."""
    mult = pow2_from_exponent(-exp)
    return nan_scale_unless_finite(mult if shift == 1.0 else mult * shift, torch.isfinite(amax))


def _blocks(x: torch.Tensor, fmt: str, check_finite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    check_high_precision(x)
    nb = check_block_divides(x, MX_BLOCK, fmt=fmt)
    xv = owned_float32(x).view(*x.shape[:-1], nb, MX_BLOCK)
    amax = block_amax(xv)
    if check_finite:
        check_finite_amax(amax)
    return xv, amax


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    rule: str = "ceil",
    scale_dtype: torch.dtype = torch.uint8,
    check_finite: bool = True,
    normal_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp8: fp8 elements, one E8M0 scale per 32 elements along K.

    Args:
        x: `[..., K]` float32 / bf16 / fp16, finite, K % 32 == 0.
        dtype: element dtype, `torch.float8_e4m3fn` or `torch.float8_e5m2`.
        rule: `"ceil"` (kernels, DeepGEMM) or `"ocp"` (OCP MX v1.0); see the module doc.
        scale_dtype: `torch.uint8` or `torch.float8_e8m0fnu` (same bytes).
        check_finite: reject NaN / inf (a host sync on CUDA).
        normal_scales: exponents at least -126, all-zero blocks byte 1 (see the module doc).

    Returns:
        `(data [..., K] dtype, scales [..., K/32] scale_dtype)`.
    """
    fmax, emax = fp8_dtype_info(dtype)
    xv, amax = _blocks(x, "mxfp8", check_finite)
    exp, byte = mx_block_exponents(
        amax, fmax=fmax, emax=emax, rule=rule, normal_scales=normal_scales
    )
    data = xv.mul_(_element_multiplier(exp, amax)).clamp_(-fmax, fmax).to(dtype)
    return data.view(x.shape), as_scale_dtype(
        byte.view(*x.shape[:-1], x.shape[-1] // MX_BLOCK), scale_dtype
    )


def _e8m0_block_scales(scales: torch.Tensor, lead: tuple[int, ...], nb: int) -> torch.Tensor:
    check_shape(scales, (*lead, nb), arg="scales", why=f"one E8M0 byte per {MX_BLOCK} elements")
    return e8m0_to_float32(scales).unsqueeze(-1)


def dequantize_mxfp8(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`data [..., K] fp8`, `scales [..., K/32]` E8M0 (uint8 / float8_e8m0fnu) -> float32."""
    check_dtype(data, (torch.float8_e4m3fn, torch.float8_e5m2), arg="data")
    nb = check_block_divides(data, MX_BLOCK, arg="data", fmt="mxfp8")
    s = _e8m0_block_scales(scales, tuple(data.shape[:-1]), nb)
    return (data.float().view(*data.shape[:-1], nb, MX_BLOCK) * s).view(data.shape)


def quantize_mxfp4(
    x: torch.Tensor,
    *,
    rule: str = "ceil",
    scale_dtype: torch.dtype = torch.uint8,
    check_finite: bool = True,
    normal_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp4: e2m1 elements packed two per byte, one E8M0 scale per 32 elements along K.

    Args:
        x: `[..., K]` float32 / bf16 / fp16, finite, K % 32 == 0.
        rule: `"ceil"` (default, see the module doc for why) or `"ocp"`.
        scale_dtype: `torch.uint8` or `torch.float8_e8m0fnu`.
        check_finite: reject NaN / inf (a host sync on CUDA).
        normal_scales: exponents at least -126, all-zero blocks byte 1 (see the module doc).

    Returns:
        `(packed [..., K/2] uint8, scales [..., K/32] scale_dtype)`; element 2i is in the low
        nibble of byte i.
    """
    xv, amax = _blocks(x, "mxfp4", check_finite)
    exp, byte = mx_block_exponents(
        amax, fmax=E2M1_MAX, emax=E2M1_EMAX, rule=rule, normal_scales=normal_scales
    )
    # 2**-e * 2**-6 >= 2**-133 is still exact in fp32 (subnormal); see e2m1_codes_from_shifted.
    codes = e2m1_codes_from_shifted(xv.mul_(_element_multiplier(exp, amax, E2M1_TO_E4M3_SHIFT)))
    packed = pack_e2m1(codes.view(x.shape))
    return packed, as_scale_dtype(byte.view(*x.shape[:-1], x.shape[-1] // MX_BLOCK), scale_dtype)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`packed [..., K/2] uint8`, `scales [..., K/32]` E8M0 -> `[..., K]` float32."""
    check_dtype(packed, (torch.uint8,), arg="packed")
    check_contiguous(packed, arg="packed")
    k = packed.shape[-1] * 2
    if k % MX_BLOCK:
        raise MoeEpUsageError(
            f"packed.shape[-1] * 2 (K) must be divisible by {MX_BLOCK}, got K={k}"
        )
    nb = k // MX_BLOCK
    s = _e8m0_block_scales(scales, tuple(packed.shape[:-1]), nb)
    vals = e2m1_codes_to_float32(unpack_e2m1(packed)).view(*packed.shape[:-1], nb, MX_BLOCK)
    return (vals * s).view(*packed.shape[:-1], k)

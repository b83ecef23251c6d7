"""fp8 (e4m3 / e5m2) with fp32 scales: per tensor, per row, and blockwise (DeepSeek-V3).

Scales multiply: x ~= data.float() * scale. The fp32 scale is `amax / fmax` (amax of the
tensor, row or block; fmax = 448 for e4m3, 57344 for e5m2), or 1.0 for an all-zero block, and
never below 2**-126 so that the division stays finite. Elements are `x / scale`, clamped to
+-fmax *before* the cast (torch's e5m2 cast overflows to inf; the saturation here is ours, not
the cast's), then cast with round-to-nearest-even.

Blockwise with `scale_format="ue8m0"`: the scale is the power of two 2**ceil(log2(amax/fmax))
(computed exactly from the fp32 amax), returned as float32; all-zero blocks get 2**-127
(E8M0 byte 0). Use `float32_pow2_to_e8m0` for the bytes.

With `check_finite=False`, a tensor, row or block holding NaN / inf gets a NaN scale and NaN
elements (`moe_ep.quant.nonfinite`).
"""

from __future__ import annotations

import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep.quant._codes import (
    E8M0_NAN,
    abs_max,
    block_amax,
    e8m0_to_float32,
    exact_ceil_log2_ratio,
    fp8_dtype_info,
    owned_float32,
    pow2_from_exponent,
)
from moe_ep.quant._validate import (
    check_dtype,
    check_finite_amax,
    check_high_precision,
    check_shape,
)
from moe_ep.quant.nonfinite import nan_scale_unless_finite

__all__ = [
    "FP8_FC2_ACT_BLOCKS",
    "dequantize_fp8_blockwise",
    "dequantize_fp8_per_row",
    "dequantize_fp8_per_tensor",
    "float32_pow2_to_e8m0",
    "quantize_fp8_blockwise",
    "quantize_fp8_per_row",
    "quantize_fp8_per_tensor",
]

FP8_FC2_ACT_BLOCKS = (64, 128)
"""1xK block sizes the fp8 blockwise kernels quantize the FC2 input (SwiGLU output) in: 128
(DeepSeek-V3; the sm90 push kernel), 64 (the sm90 pull kernel: its drop's
`Fp8Fc2ActivationScaleK`)."""

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MIN_FP32_SCALE = 2.0**-126
_SCALE_FORMATS = ("fp32", "ue8m0")


def _fp32_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    scale = (amax / fmax).clamp_min(_MIN_FP32_SCALE)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return nan_scale_unless_finite(scale, torch.isfinite(amax))


def _ue8m0_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    exp = exact_ceil_log2_ratio(amax, fmax).clamp(-127, 127)
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127))
    return nan_scale_unless_finite(pow2_from_exponent(exp), torch.isfinite(amax))


def _cast(scaled: torch.Tensor, fmax: float, dtype: torch.dtype) -> torch.Tensor:
    return scaled.clamp_(-fmax, fmax).to(dtype)


def quantize_fp8_per_tensor(
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with one fp32 scale for the whole tensor.

    Args:
        x: `[..., K]` float32 / bf16 / fp16, finite.
        dtype: `torch.float8_e4m3fn` or `torch.float8_e5m2`.
        check_finite: reject NaN / inf (a host sync on CUDA).

    Returns:
        `(data [..., K] dtype, scale [] float32)` with x ~= data.float() * scale.
    """
    check_high_precision(x)
    fmax, _ = fp8_dtype_info(dtype)
    xf = owned_float32(x)
    amax = torch.maximum(xf.amax(), xf.amin().neg_()) if xf.numel() else xf.new_zeros(())
    if check_finite:
        check_finite_amax(amax)
    scale = _fp32_scale(amax, fmax)
    return _cast(xf.div_(scale), fmax, dtype), scale


def dequantize_fp8_per_tensor(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`data [...] fp8`, `scale []` (or any shape broadcasting to data) -> float32."""
    check_dtype(data, _FP8_DTYPES, arg="data")
    check_dtype(scale, (torch.float32,), arg="scale")
    return data.float() * scale


def quantize_fp8_per_row(
    x: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize with one fp32 scale per row (the last dim is the row).

    Returns:
        `(data [..., K] dtype, scales [..., 1] float32)`.
    """
    check_high_precision(x)
    fmax, _ = fp8_dtype_info(dtype)
    xf = owned_float32(x)
    amax = block_amax(xf)
    if check_finite:
        check_finite_amax(amax)
    scale = _fp32_scale(amax, fmax)
    return _cast(xf.div_(scale), fmax, dtype), scale


def dequantize_fp8_per_row(data: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`data [..., K] fp8`, `scales [..., 1] float32` -> `[..., K]` float32."""
    check_dtype(data, _FP8_DTYPES, arg="data")
    check_dtype(scales, (torch.float32,), arg="scales")
    check_shape(scales, (*data.shape[:-1], 1), arg="scales", why="one scale per row of data")
    return data.float() * scales


def _check_block(block: object) -> tuple[int, int]:
    ok = (
        isinstance(block, tuple | list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    )
    if not ok:
        raise MoeEpUsageError(
            f"block must be a pair of positive ints (rows, K), e.g. (1, 128) or (128, 128), "
            f"got {block!r}"
        )
    return int(block[0]), int(block[1])  # type: ignore[index]


def quantize_fp8_blockwise(
    x: torch.Tensor,
    *,
    block: tuple[int, int] = (1, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
    scale_format: str = "fp32",
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise fp8 (DeepSeek-V3): 1x128 blocks for activations, 128x128 for weights.

    Args:
        x: activations `[..., K]` (block `(1, bk)`) or weights `[..., N, K]` (block `(bn, bk)`
            with bn > 1); float32 / bf16 / fp16, finite. K must be a multiple of bk; N may be
            ragged (the last row block is partial, scaled by the amax of its real rows).
        block: `(bn, bk)`.
        dtype: `torch.float8_e4m3fn` (the recipe) or `torch.float8_e5m2`.
        scale_format: `"fp32"` (amax / fmax) or `"ue8m0"` (power of two, ceil rule; float32).
        check_finite: reject NaN / inf (a host sync on CUDA).

    Returns:
        `(data, scales)`: data has x's shape and `dtype`; scales float32 `[..., K/bk]` for
        bn == 1, `[..., ceil(N/bn), K/bk]` otherwise.
    """
    check_high_precision(x)
    bn, bk = _check_block(block)
    fmax, _ = fp8_dtype_info(dtype)
    if scale_format not in _SCALE_FORMATS:
        raise MoeEpUsageError(f"scale_format must be one of {_SCALE_FORMATS}, got {scale_format!r}")
    if bn > 1 and x.dim() < 2:
        raise MoeEpUsageError(
            f"x must be [..., N, K] for block {block}, got shape {tuple(x.shape)}"
        )
    k = x.shape[-1]
    if k % bk != 0:
        raise MoeEpUsageError(
            f"x.shape[-1] (K) must be divisible by the fp8 block K of {bk}, got K={k} "
            f"(shape {tuple(x.shape)})"
        )
    xf = owned_float32(x)
    if bn == 1:
        xv = xf.view(*xf.shape[:-1], k // bk, bk)
        amax = block_amax(xv)
    else:
        n = x.shape[-2]
        n_pad = -(-n // bn) * bn
        if n_pad != n:
            xf = torch.nn.functional.pad(xf, (0, 0, 0, n_pad - n))
        xv = xf.view(*xf.shape[:-2], n_pad // bn, bn, k // bk, bk)
        if xv.numel():
            amax = abs_max(xv, (-3, -1))
        else:
            amax = xv.new_zeros((*xv.shape[:-3], 1, k // bk, 1))
    if check_finite:
        check_finite_amax(amax)
    scale = _ue8m0_scale(amax, fmax) if scale_format == "ue8m0" else _fp32_scale(amax, fmax)
    data = _cast(xv.div_(scale), fmax, dtype)
    if bn == 1:
        return data.view(x.shape), scale.view(*x.shape[:-1], k // bk)
    data = data.view(*xf.shape)[..., : x.shape[-2], :]
    return data.contiguous(), scale.view(*scale.shape[:-4], scale.shape[-4], k // bk)


def dequantize_fp8_blockwise(
    data: torch.Tensor, scales: torch.Tensor, *, block: tuple[int, int] = (1, 128)
) -> torch.Tensor:
    """Inverse of `quantize_fp8_blockwise` -> float32 of data's shape.

    `scales` are float32 (either scale format) or E8M0 bytes (uint8 / float8_e8m0fnu).
    """
    check_dtype(data, _FP8_DTYPES, arg="data")
    check_dtype(scales, (torch.float32, torch.uint8, torch.float8_e8m0fnu), arg="scales")
    bn, bk = _check_block(block)
    s = scales if scales.dtype == torch.float32 else e8m0_to_float32(scales)
    k = data.shape[-1]
    if k % bk != 0:
        raise MoeEpUsageError(f"data.shape[-1] must be divisible by the block K of {bk}, got {k}")
    if bn == 1:
        check_shape(s, (*data.shape[:-1], k // bk), arg="scales", why=f"one per 1x{bk} block")
        return (data.float().view(*data.shape[:-1], k // bk, bk) * s.unsqueeze(-1)).view(data.shape)
    if data.dim() < 2:
        raise MoeEpUsageError(
            f"data must be [..., N, K] for block {block}, got shape {tuple(data.shape)}"
        )
    n = data.shape[-2]
    expected = (*data.shape[:-2], -(-n // bn), k // bk)
    check_shape(s, expected, arg="scales", why=f"one per {bn}x{bk} block")
    full = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)
    return data.float() * full


def float32_pow2_to_e8m0(scales: torch.Tensor) -> torch.Tensor:
    """Exact E8M0 bytes (uint8) of float32 powers of two in [2**-127, 2**127]; NaN (the
    scale of a non-finite block) becomes byte 255, E8M0's NaN.

    Raises `MoeEpUsageError` if any other value is not such a power of two (a host sync on
    CUDA).
    """
    check_dtype(scales, (torch.float32,), arg="scales")
    bits = scales.contiguous().view(torch.int32)
    normal = (bits & 0x007FFFFF) == 0
    byte = (bits >> 23) & 0xFF
    nan = torch.isnan(scales)
    ok = (bits >= 0) & ((normal & (byte >= 1) & (byte <= 254)) | (bits == 0x00400000)) | nan
    if scales.numel() and not bool(ok.all()):
        raise MoeEpUsageError(
            "scales must hold float32 powers of two in [2**-127, 2**127] (or NaN) to become "
            "E8M0 bytes (e.g. the output of scale_format='ue8m0')"
        )
    byte = torch.where(bits == 0x00400000, torch.zeros_like(byte), byte)
    return torch.where(nan, torch.full_like(byte, E8M0_NAN), byte).to(torch.uint8)

"""The sm90 MXFP4 x FP8 kernel's numerics (`fp8_scale_mode="mxfp4_hybrid"`), on any device.

Three pieces, each what the Hopper kernel `Sm90MegaMoESwapABMxfp4Fp8Kernel` (flashinfer 0.7.4,
`moe_hopper_fp8`) computes, so the portable twin reproduces it:

- FC1 input: e4m3 with ONE fp32 scale per token over the whole hidden row,
  `scale = max(amax * fp32(1/448), 1e-30)` (the multiply by a rounded reciprocal is what
  torch's CUDA division by a scalar does in the kernel's staging), elements `x / scale`.
- FC2 input (the SwiGLU output): e4m3 in 1x64 blocks, the same scale rule, elements
  `x * fp32(1 / scale)` (the kernel's epilogue multiplies by the reciprocal).
- Weights: mxfp4 (e2m1 codes, one E8M0 byte per 32 along K) whose exponents are clamped
  per expert to a range of `HUMMING_MAX_RANGE` = 11 binades below the expert's largest
  byte (the kernel expands e2m1 to e4m3 with a 4-bit exponent offset): a block whose byte
  is `delta` below that floor takes the floor byte and each element `v * 2**-delta`
  rounded to the nearest e2m1 value, ties away from zero.

Non-finite activations follow `moe_ep.quant.nonfinite` (NaN scale, NaN row / block).
"""

from __future__ import annotations

import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep.quant._codes import (
    E2M1_VALUES,
    block_amax,
    e2m1_codes_to_float32,
    owned_float32,
    pack_e2m1,
    unpack_e2m1,
)
from moe_ep.quant._validate import check_dtype, check_finite_amax, check_high_precision
from moe_ep.quant.nonfinite import nan_scale_unless_finite

__all__ = [
    "HUMMING_MAX_RANGE",
    "HYBRID_FC2_BLOCK",
    "clamp_mxfp4_exponent_range",
    "quantize_fp8_fc2_hybrid",
    "quantize_fp8_per_token_hybrid",
]

HUMMING_MAX_RANGE = 11
"""Binades of E8M0 weight exponents the kernel keeps per expert (its `humming_max_range`)."""
HYBRID_FC2_BLOCK = 64
"""Elements per fp32 scale of the FC2 input (the drop's `Fp8Fc2ActivationScaleK`)."""

_E4M3_MAX = 448.0
_SCALE_FLOOR = 1.0e-30


def _hybrid_scale(amax: torch.Tensor) -> torch.Tensor:
    rcp = torch.tensor(1.0 / _E4M3_MAX, dtype=torch.float32, device=amax.device)
    scale = (amax * rcp).clamp_min(_SCALE_FLOOR)
    return nan_scale_unless_finite(scale, torch.isfinite(amax))


def quantize_fp8_per_token_hybrid(
    x: torch.Tensor, *, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., H]` -> `(e4m3 [..., H], fp32 scales [..., 1])`, x ~= data.float() * scale.

    One scale per row: `max(amax * fp32(1/448), 1e-30)`; elements `x / scale`, clamped to
    +-448, cast round-to-nearest-even. `check_finite` rejects NaN / inf (a host sync on CUDA).
    """
    check_high_precision(x)
    xf = owned_float32(x)
    amax = block_amax(xf)
    if check_finite:
        check_finite_amax(amax)
    scale = _hybrid_scale(amax)
    data = xf.div_(scale).clamp_(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return data, scale.reshape(-1).view(*x.shape[:-1], 1)  # row-major strides when empty too


def quantize_fp8_fc2_hybrid(
    x: torch.Tensor, *, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., I]` (I % 64 == 0) -> `(e4m3 [..., I], fp32 scales [..., I/64])`.

    Per 1x64 block: `scale = max(amax * fp32(1/448), 1e-30)`, elements `x * fp32(1/scale)`.
    Dequantize with `dequantize_fp8_blockwise(data, scales, block=(1, 64))`.
    """
    check_high_precision(x)
    k = int(x.shape[-1])
    if k % HYBRID_FC2_BLOCK:
        raise MoeEpUsageError(
            f"x.shape[-1] must be a multiple of {HYBRID_FC2_BLOCK} (the FC2-input block), got {k}"
        )
    xv = owned_float32(x).view(*x.shape[:-1], k // HYBRID_FC2_BLOCK, HYBRID_FC2_BLOCK)
    amax = block_amax(xv)
    if check_finite:
        check_finite_amax(amax)
    scale = _hybrid_scale(amax)
    data = xv.mul_(torch.reciprocal(scale)).clamp_(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return data.view(x.shape), scale.view(*x.shape[:-1], k // HYBRID_FC2_BLOCK)


def _round_e2m1_ties_away(mag: torch.Tensor) -> torch.Tensor:
    """Magnitudes in [0, 6] -> e2m1 magnitude codes 0..7, nearest value, ties upward."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=mag.device)
    midpoints = (grid[1:] + grid[:-1]) / 2
    return torch.bucketize(mag, midpoints, right=True).to(torch.uint8)


def clamp_mxfp4_exponent_range(
    packed: torch.Tensor, scales: torch.Tensor, *, max_range: int = HUMMING_MAX_RANGE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert (dim 0), raise every E8M0 byte to at least `max(bytes) - max_range` and
    rescale the codes of each raised block (see the module doc).

    Args:
        packed: `[E, N, K/2]` uint8 e2m1 codes (low nibble first).
        scales: `[E, N, K/32]` uint8 E8M0 bytes, none 255 (NaN).
        max_range: 0..11.

    Returns:
        `(packed, scales)` of the same shapes; -0 codes become +0.
    """
    check_dtype(packed, (torch.uint8,), arg="packed")
    check_dtype(scales, (torch.uint8,), arg="scales")
    if type(max_range) is not int or not 0 <= max_range <= HUMMING_MAX_RANGE:
        raise MoeEpUsageError(f"max_range must be an int in [0, 11], got {max_range!r}")
    if packed.dim() != 3 or tuple(scales.shape) != (*packed.shape[:2], packed.shape[2] * 2 // 32):
        raise MoeEpUsageError(
            f"packed must be [E, N, K/2] and scales [E, N, K/32], got {tuple(packed.shape)} "
            f"and {tuple(scales.shape)}"
        )
    e = int(packed.shape[0])
    s = scales.to(torch.int32)
    if e == 0 or s.numel() == 0:
        return packed.clone(), scales.clone()
    floor = s.view(e, -1).amax(dim=1) - max_range
    raised = torch.maximum(s, floor.view(e, 1, 1))
    delta = (raised - s).unsqueeze(-1)  # [E, N, K/32, 1]
    codes = unpack_e2m1(packed.contiguous()).view(*s.shape, 32)
    mag = e2m1_codes_to_float32(codes & 0x7) * torch.exp2(-delta.float())
    sign = torch.where(codes >= 8, 8, 0).to(torch.uint8)
    new_mag = _round_e2m1_ties_away(mag)
    new = torch.where(new_mag == 0, 0, new_mag | sign).to(torch.uint8)
    return pack_e2m1(new.view(*packed.shape[:2], -1)), raised.to(torch.uint8)

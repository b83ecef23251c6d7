"""The sm90 NVFP4 x FP8 kernel's weight numerics, on any device.

nvfp4 weights (e2m1 codes, one e4m3 scale per 16 along K, one fp32 scale per expert) as
flashinfer 0.7.4's Hopper `Sm90MegaMoESwapABNvfp4Fp8Kernel` takes them; its activations are
`moe_ep.quant.mxfp4_hybrid`'s (the two kernels share their activation path). Unlike the sm100
rule of `moe_ep.quant.nvfp4` (a norm_const multiplied in), the per-expert scale here is a
decode scale G (weight = G * e2m1 * scale) and the host quantizer divides
(`backends/mega/kernel/sm90/fp8_nvfp4_bf16_pull_cutedsl/weights.py::_quantize_leg`; docs/quant.md):

    G       = max(amax(expert) * fp32(1/2688), 1e-30)          (torch's CUDA `/ 2688`)
    scale   = e4m3(clamp(amax16 / fp32(6 * G), 0, 448))          (RNE cast)
    payload = RNE_e2m1(v / max(fp32(float(scale) * G), 1e-30))   (saturating at +-6)

The kernel never multiplies e2m1 by the scale in fp32: it promotes each weight to the e4m3
operand `RN_E4M3(e2m1 * scale / 8)` (`nvfp4_e4m3_operand`, a 127 x 8 table in the kernel) and
multiplies the GEMM's fp32 output by `8 * G` in its epilogue (`NVFP4_EPILOGUE_COMPENSATION`).
"""

from __future__ import annotations

import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep.quant._codes import (
    E2M1_MAX,
    E2M1_TO_E4M3_SHIFT,
    block_amax,
    e2m1_codes_from_shifted,
    owned_float32,
    pack_e2m1,
)
from moe_ep.quant._validate import (
    check_block_divides,
    check_dtype,
    check_finite_amax,
    check_high_precision,
)
from moe_ep.quant.nvfp4 import NVFP4_BLOCK, dequantize_nvfp4, tensor_amax

__all__ = [
    "NVFP4_EPILOGUE_COMPENSATION",
    "nvfp4_decode_scale",
    "nvfp4_e4m3_operand",
    "quantize_nvfp4_decode_scaled",
]

NVFP4_EPILOGUE_COMPENSATION = 8.0
"""The kernel's operand is e2m1 * scale / 8; its epilogue multiplies by 8 * G."""

_E4M3_MAX = 448.0
_FLOOR = 1.0e-30
_RCP_2688 = 1.0 / (E2M1_MAX * _E4M3_MAX)  # rounded to fp32 where it meets a tensor


def nvfp4_decode_scale(
    x: torch.Tensor, *, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """G = max(amax(x) * fp32(1/2688), 1e-30) in float32 (the multiply by a rounded
    reciprocal is torch's CUDA division by a scalar, where the host quantizer runs).

    Args:
        x: finite float32 / bf16 / fp16 tensor, e.g. all experts' w13 `[E, 2I, H]`.
        dim: None for one scalar; dims to reduce (kept, size 1) otherwise, e.g.
            `dim=(-2, -1)` gives one G per expert `[E, 1, 1]`.
    """
    return tensor_amax(x, dim=dim).mul_(_RCP_2688).clamp_min_(_FLOOR)


def _decode_scale_blocks(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    check_dtype(g, (torch.float32,), arg="decode_scale")
    if g.dim() > x.dim() or (g.dim() and g.shape[-1] != 1):
        raise MoeEpUsageError(
            "decode_scale must be a 0-dim or float32 tensor with a size-1 last dim "
            f"broadcasting to x {tuple(x.shape)} (e.g. [E, 1, 1]), got {tuple(g.shape)}"
        )
    aligned = zip(reversed(g.shape), reversed(x.shape), strict=False)
    if any(a not in (1, b) for a, b in aligned):
        raise MoeEpUsageError(
            f"decode_scale shape {tuple(g.shape)} does not broadcast to x {tuple(x.shape)}"
        )
    if g.numel() and not bool((torch.isfinite(g) & (g > 0)).all()):
        raise MoeEpUsageError("decode_scale must be positive and finite")
    return g.unsqueeze(-1) if g.dim() else g  # against the [..., K/16, 1] amax view


def quantize_nvfp4_decode_scaled(
    x: torch.Tensor, *, decode_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """nvfp4 with a decode scale G, the sm90 kernel's host rule (see the module doc).

    Args:
        x: `[..., K]` finite float32 / bf16 / fp16, K % 16 == 0.
        decode_scale: float32 G, 0-dim or `[..., 1]` broadcasting to x (per expert
            `[E, 1, 1]`, e.g. `nvfp4_decode_scale(w, dim=(-2, -1))`), positive and finite.

    Returns:
        `(packed [..., K/2] uint8, scales [..., K/16] float8_e4m3fn)`, element 2i in the low
        nibble of byte i; x ~= G * e2m1 * scale (`dequantize_nvfp4(packed, scales) * G`).
        A block whose scale rounds to 0 divides by the 1e-30 floor: its codes saturate, and
        its values are 0 (times the zero scale).
    """
    check_high_precision(x)
    nb = check_block_divides(x, NVFP4_BLOCK, fmt="nvfp4")
    g = _decode_scale_blocks(decode_scale, x)
    xv = owned_float32(x).view(*x.shape[:-1], nb, NVFP4_BLOCK)
    amax = block_amax(xv)
    check_finite_amax(amax)
    scale = amax.div_(g * E2M1_MAX).clamp_(0.0, _E4M3_MAX).to(torch.float8_e4m3fn)
    divisor = (scale.float() * g).clamp_min_(_FLOOR)
    # One rounding of v / divisor, then the exact 2**-6 shift e2m1_codes_from_shifted takes.
    codes = e2m1_codes_from_shifted(xv.div_(divisor).mul_(E2M1_TO_E4M3_SHIFT))
    return pack_e2m1(codes.view(x.shape)), scale.view(*x.shape[:-1], nb)


def nvfp4_e4m3_operand(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's GEMM operand: `[..., K/2]` e2m1 codes and `[..., K/16]` e4m3 scales ->
    `[..., K]` float8_e4m3fn `RN_E4M3(e2m1 * scale / 8)` (round to nearest even, e4m3
    subnormals kept; the product is exact in fp32 and at most 336, so nothing saturates).
    The weight is this times `8 * G`."""
    product = dequantize_nvfp4(packed, scales)  # e2m1 * scale, exact in fp32
    return product.mul_(1.0 / NVFP4_EPILOGUE_COMPENSATION).to(torch.float8_e4m3fn)

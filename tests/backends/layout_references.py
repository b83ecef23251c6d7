"""Test references of the kernel-ready weight layouts: each undoes a `prepare_*_weights`
into the fp32 values the kernel multiplies with (what the layout tests compare against
the portable recipes and the drops' own references). Test code: product code never
dequantizes its prepared weights."""

from __future__ import annotations

import torch

from moe_ep.quant import (
    deinterleave_gate_up,
    dequantize_mxfp4,
    dequantize_mxfp8,
    dequantize_nvfp4,
    unswizzle_128x4,
)
from moe_ep.quant.fp8 import dequantize_fp8_blockwise
from moe_ep_sm90.common.fp8_blockwise import Fp8BlockWeights
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.config import PULL_GATE_UP_BLOCK
from moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.layout import (
    DEEPGEMM_GATE_UP_BLOCK,
    UTCCP_ROWS,
    DeepgemmWeights,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.layout import (
    MXFP8_GATE_UP_BLOCK,
    Mxfp8Weights,
)
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.layout import (
    NVFP4_GATE_UP_BLOCK,
    Nvfp4Weights,
)

FP8_W = (128, 128)
NVFP4_BLOCK = 16
MXFP8_BLOCK = 32


def dequantize_pull_weights(weights: Fp8BlockWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo `prepare_pull_weights`: the fp32 values the kernel multiplies with.

    Returns `w13 [E_local, 2I, H]` (gate rows then up rows) and `w2 [E_local, H, I]`.
    """
    w13 = dequantize_fp8_blockwise(weights.w13.permute(0, 2, 1), weights.w13_scales, block=FP8_W)
    w2 = dequantize_fp8_blockwise(weights.w2.permute(0, 2, 1), weights.w2_scales, block=FP8_W)
    return deinterleave_gate_up(w13, PULL_GATE_UP_BLOCK), w2


def dequantize_push_weights(weights: Fp8BlockWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo `prepare_push_weights`: fp32 `(w13 [E_local, 2I, H], w2 [E_local, H, I])`."""
    return (
        dequantize_fp8_blockwise(weights.w13, weights.w13_scales, block=FP8_W),
        dequantize_fp8_blockwise(weights.w2, weights.w2_scales, block=FP8_W),
    )


def dequantize_nvfp4_weights(weights: Nvfp4Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo the layout: fp32 `w13 [E_local, 2I, H]` (gate, up) and `w2 [E_local, H, I]` as
    `e2m1 * scale`, without the global scales (those are in the alphas)."""
    q13 = weights.w13.permute(0, 2, 1).contiguous()
    q2 = weights.w2.permute(0, 2, 1).contiguous()
    two_i, h = q13.shape[1], q13.shape[2] * 2
    i = q2.shape[2] * 2
    s13 = unswizzle_128x4(weights.w13_scales.view(torch.uint8), two_i, h // NVFP4_BLOCK)
    s2 = unswizzle_128x4(weights.w2_scales.view(torch.uint8), h, i // NVFP4_BLOCK)
    w13 = dequantize_nvfp4(q13, s13.view(torch.float8_e4m3fn))
    w2 = dequantize_nvfp4(q2, s2.view(torch.float8_e4m3fn))
    return deinterleave_gate_up(w13, NVFP4_GATE_UP_BLOCK), w2


def dequantize_mxfp8_weights(weights: Mxfp8Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo `prepare_mxfp8_weights`: fp32 `w13 [E_local, 2I, H]` (gate, up) and `w2`."""
    q13 = weights.w13.permute(0, 2, 1)
    q2 = weights.w2.permute(0, 2, 1)
    _, two_i, h = q13.shape
    i = q2.shape[-1]
    s13 = unswizzle_128x4(weights.w13_scales, two_i, h // MXFP8_BLOCK)
    s2 = unswizzle_128x4(weights.w2_scales, h, i // MXFP8_BLOCK)
    w13 = deinterleave_gate_up(dequantize_mxfp8(q13, s13), MXFP8_GATE_UP_BLOCK)
    return w13, dequantize_mxfp8(q2, s2)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_ue8m0`: `[..., K/128]` int32 -> `[..., K/32]` uint8 (contiguous):
    byte j of int c (little-endian) is the scale of K-block 4c + j."""
    return packed.contiguous().view(torch.uint8)


def utccp_rows_inverse(sf: torch.Tensor) -> torch.Tensor:
    """Inverse of `utccp_rows`: input row `32i + j` of each 128-row group is kernel row
    `4j + i` (i < 4, j < 32)."""
    e, n, c = sf.shape
    assert n % UTCCP_ROWS == 0, sf.shape
    return sf.reshape(e, n // UTCCP_ROWS, 32, 4, c).transpose(2, 3).reshape(e, n, c)


def dequantize_deepgemm_weights(weights: DeepgemmWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """Undo `prepare_deepgemm_weights`: fp32 `w13 [E_local, 2I, H]` (gate, up), `w2`."""

    def plane(packed_sf: torch.Tensor) -> torch.Tensor:
        return unpack_ue8m0(utccp_rows_inverse(packed_sf.contiguous()))

    b = DEEPGEMM_GATE_UP_BLOCK
    q13 = deinterleave_gate_up(weights.w13.view(torch.uint8), b)
    s13 = deinterleave_gate_up(plane(weights.w13_scales), b)
    w2 = dequantize_mxfp4(weights.w2.view(torch.uint8).contiguous(), plane(weights.w2_scales))
    return dequantize_mxfp4(q13, s13), w2

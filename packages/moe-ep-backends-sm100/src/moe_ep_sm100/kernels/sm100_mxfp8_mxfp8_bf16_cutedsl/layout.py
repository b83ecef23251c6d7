"""Kernel-ready mxfp8 weights and staged inputs of `sm100_mxfp8_mxfp8_bf16_cutedsl` (torch).

Runs on CPU or CUDA tensors alike. Recipe (`moe_ep.quant.quantize_mxfp8`, "ceil" rule, the
drop's own): e4m3 elements, one E8M0 byte per 32 elements along K. Because the scale blocks
run along K inside one row, permuting rows (the gate/up interleave) commutes with
quantization: the kernel's weights are exactly the portable mxfp8 recipe's, and
pre-quantized packs are re-laid out without requantizing.

Kernel layout (the drop's runner): FC1 rows gate/up interleaved in blocks of 32; weights as
K-major views `fc1 [E_local, H, 2I]`, `fc2 [E_local, I, H]` (stride 1 on dim 1) of
`[E_local, N, K]` storage; scale planes 128x4-swizzled per expert and flattened to
`[E_local, ceil128(N) * ceil4(K/32)]` E8M0 bytes.
"""

from __future__ import annotations

import torch

from moe_ep_sm100.common.mx_layout import MxWeights as Mxfp8Weights
from moe_ep_sm100.common.mx_layout import StagedMxfp8Inputs, prepare_mx_weights, stage_mxfp8

__all__ = [
    "MXFP8_GATE_UP_BLOCK",
    "Mxfp8Weights",
    "StagedMxfp8Inputs",
    "prepare_mxfp8_weights",
    "stage_mxfp8_inputs",
]

MXFP8_GATE_UP_BLOCK = 32


def prepare_mxfp8_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> Mxfp8Weights:
    """Weights in the form the mxfp8 kernel reads.

    Args:
        w13: `[E_local, 2I, H]` gate rows then up rows; bf16/fp32, or e4m3 with `w13_scale`
            `[E_local, 2I, H/32]` E8M0 bytes (canonical, unswizzled).
        w2: `[E_local, H, I]`, likewise with `w2_scale` `[E_local, H, I/32]`.
    """
    from moe_ep.quant import quantize_mxfp8

    return prepare_mx_weights(
        w13, w2, w13_scale, w2_scale, gate_up_block=MXFP8_GATE_UP_BLOCK,
        quantize=quantize_mxfp8, payload_dtype=torch.float8_e4m3fn, payload_name="float8_e4m3fn",
    )  # fmt: skip


def stage_mxfp8_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
) -> StagedMxfp8Inputs:
    """Quantize and pad `[n, H]` bf16 inputs into fresh mxfp8 staging buffers of T rows:
    the drop's ceil rule, the scale plane `[T, ceil4(H/32)]`, int64 ids."""
    return stage_mxfp8(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens,
        sf_column_multiple=4, normal_scales=False, ids_dtype=torch.int64,
    )  # fmt: skip

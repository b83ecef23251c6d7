"""Kernel-ready mxfp4 weights and staged mxfp8 inputs of `sm100_mxfp8_mxfp4_bf16_cutedsl`
(torch; CPU or CUDA tensors alike).

Recipe (`moe_ep.quant` with `normal_scales=True`, the portable twin
`any_mxfp8_mxfp4_bf16_torch`'s `Mxfp8Mxfp4Recipe`; docs/quant.md, "The sm100 MXFP4 x MXFP8
kernel's numerics"): weights e2m1 packed two per byte (element 2j in the low nibble of byte
j), one E8M0 byte per 32 elements along K, `e = max(ceil(log2(amax / 6)), -126)` (an
all-zero block: byte 1), codes rounded to nearest even (`quantize_mxfp4`); activations e4m3
with one E8M0 byte per 32 elements, `e = max(ceil(log2(amax / 448)), -126)`
(`quantize_mxfp8`). The scale blocks run along K inside one row, so permuting rows (the
gate/up interleave) commutes with quantization, and pre-quantized packs are re-laid out
without requantizing.

Kernel layout (the drop's `aot_compile` ABI): FC1 rows gate/up interleaved in blocks of 16
(data and scale rows alike); packed weights as K-major views `fc1 [E_local, H/2, 2I]`,
`fc2 [E_local, I/2, H]` bytes (stride 1 on dim 1; the kernel reads `[E_local, H, 2I]` /
`[E_local, I, H]` e2m1 elements) of `[E_local, N, K/2]` storage; weight scale planes
128x4-swizzled per expert, flattened to `[E_local, ceil128(N) * ceil4(K/32)]` E8M0 bytes.
Staged activation scales are linear (not swizzled): `[T, ceil16(H/32)]`.
"""

from __future__ import annotations

import torch

from moe_ep.backends.support.launch_args import ceil_to
from moe_ep_sm100.common.mx_layout import MxWeights as Mxfp4Weights
from moe_ep_sm100.common.mx_layout import StagedMxfp8Inputs, prepare_mx_weights, stage_mxfp8
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import MX_BLOCK

__all__ = [
    "ACTIVATION_SF_COLUMN_MULTIPLE",
    "GATE_UP_BLOCK",
    "Mxfp4Weights",
    "StagedMxfp8Inputs",
    "activation_sf_columns",
    "prepare_mxfp4_weights",
    "stage_mxfp8_inputs",
]

GATE_UP_BLOCK = 16
"""FC1 rows per gate / up stripe (the swap-AB gated epilogue's N layout)."""

ACTIVATION_SF_COLUMN_MULTIPLE = 16
"""Staged activation-scale columns are padded to 16 bytes (`token_comm`'s
`activation_sf_hidden_padded`); `upstream` checks the built kernel agrees."""


def activation_sf_columns(hidden_size: int) -> int:
    """Columns of the staged E8M0 activation-scale plane: `ceil16(H / 32)`."""
    return ceil_to(hidden_size // MX_BLOCK, ACTIVATION_SF_COLUMN_MULTIPLE)


def _quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from moe_ep.quant import quantize_mxfp4

    return quantize_mxfp4(w, normal_scales=True)


def prepare_mxfp4_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> Mxfp4Weights:
    """Weights in the form the kernel reads.

    Args:
        w13: `[E_local, 2I, H]` gate rows then up rows, bf16/fp32; or uint8 `[E_local, 2I, H/2]`
            e2m1 codes (element 2j in the low nibble of byte j) with `w13_scale`
            `[E_local, 2I, H/32]` E8M0 bytes (canonical, unswizzled).
        w2: `[E_local, H, I]`, likewise (uint8 `[E_local, H, I/2]` with `w2_scale`
            `[E_local, H, I/32]`).
    """
    return prepare_mx_weights(
        w13, w2, w13_scale, w2_scale, gate_up_block=GATE_UP_BLOCK, quantize=_quantize_weight,
        payload_dtype=torch.uint8, payload_name="uint8 (packed e2m1)", values_per_item=2,
    )  # fmt: skip


def stage_mxfp8_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
) -> StagedMxfp8Inputs:
    """Quantize and pad `[n, H]` bf16 inputs into fresh mxfp8 staging buffers of
    `max_tokens` rows (`config.padded_tokens_per_rank`): E8M0 normal scales, their plane
    `[T, ceil16(H/32)]`, int32 ids."""
    return stage_mxfp8(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens,
        sf_column_multiple=ACTIVATION_SF_COLUMN_MULTIPLE, normal_scales=True,
        ids_dtype=torch.int32,
    )  # fmt: skip

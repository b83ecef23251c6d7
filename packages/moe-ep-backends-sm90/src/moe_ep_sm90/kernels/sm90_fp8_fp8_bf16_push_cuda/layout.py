"""The push kernel's weights and staged inputs (pure torch, CPU or CUDA tensors alike).

FC1 keeps gate-then-up rows, weights stay `[E_local, N, K]` contiguous e4m3 with 128x128
fp32 scales (bit-identical to the portable `any_fp8_fp8_bf16_torch` weights); activations
are staged as bf16 (the drop's dispatch quantizes them); token ids are int32. Glossary and
recipe: `moe_ep_sm90.common.fp8_blockwise`.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_ep.backends.support.staging import check_staging_inputs, stage_routing
from moe_ep_sm90.common.config import FP8_BLOCK
from moe_ep_sm90.common.fp8_blockwise import (
    Fp8BlockWeights,
    StagedInputs,
    aligned,
    quantize_weight_blocks,
)

__all__ = ["prepare_push_weights", "push_weights_from_pack", "stage_push_inputs"]


def prepare_push_weights(w13: torch.Tensor, w2: torch.Tensor) -> Fp8BlockWeights:
    """Weights in the form the push kernel reads: contiguous `[E_local, N, K]` e4m3 (gate, up)."""
    q13, s13 = quantize_weight_blocks(w13)
    q2, s2 = quantize_weight_blocks(w2)
    return Fp8BlockWeights(w13=q13, w13_scales=s13, w2=q2, w2_scales=s2)


def push_weights_from_pack(weights: Any) -> Fp8BlockWeights:
    """A checked canonical pre-quantized pack in the push kernel's form (contiguous
    `[E_local, N, K]` e4m3 and fp32 scales: the pack itself, as `prepare_push_weights`)."""
    return Fp8BlockWeights(
        w13=aligned(weights.w13),
        w13_scales=aligned(weights.w13_scale),
        w2=aligned(weights.w2),
        w2_scales=aligned(weights.w2_scale),
    )


def stage_push_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
) -> StagedInputs:
    """Pad one rank's inputs into fresh push-kernel staging buffers (bf16, int32 ids)."""
    n, h, _ = check_staging_inputs(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=FP8_BLOCK
    )
    activation = torch.zeros((max_tokens, h), dtype=torch.bfloat16, device=hidden_states.device)
    activation[:n] = hidden_states
    ids, weights = stage_routing(topk_ids, topk_weights, max_tokens, ids_dtype=torch.int32)
    return StagedInputs(activation, None, ids, weights, n)

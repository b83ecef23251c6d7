"""The pull kernel's weights and staged inputs (pure torch, CPU or CUDA tensors alike).

FC1 rows are gate/up interleaved in blocks of 8 *before* quantizing (the kernel's 128-row
scale blocks run over interleaved rows, so scale block j covers gate rows and up rows
`[64j, 64j + 64)`); weights are passed as K-major views `[E_local, K, N]` (K stride 1) of
the `[E_local, N, K]` storage; staged activations are e4m3 with a `[T, ceil4(H/128)]` fp32
scale plane; token ids are int64. (The kernel quantizes its FC2 input itself, in 1x64
blocks: its drop's `Fp8Fc2ActivationScaleK`; the oracle's `fc2_act_block=64`.) Glossary and
recipe: `moe_ep_sm90.common.fp8_blockwise`.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_ep.backends.support.launch_args import ceil_to
from moe_ep.backends.support.staging import check_staging_inputs, stage_routing
from moe_ep_sm90.common.config import FP8_BLOCK
from moe_ep_sm90.common.fp8_blockwise import (
    Fp8BlockWeights,
    StagedInputs,
    aligned,
    quantize_weight_blocks,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.config import PULL_GATE_UP_BLOCK

__all__ = [
    "prepare_pull_weights",
    "pull_weights_from_pack",
    "quantize_pull_pack",
    "stage_pull_inputs",
]


def prepare_pull_weights(w13: torch.Tensor, w2: torch.Tensor) -> Fp8BlockWeights:
    """Weights in the form the pull kernel reads.

    Args:
        w13: `[E_local, 2I, H]` bf16/fp32, gate rows then up rows.
        w2: `[E_local, H, I]` bf16/fp32.

    Returns:
        `w13` as the K-major view `[E_local, H, 2I]` (stride 1 along H) of gate/up-interleaved
        (blocks of 8) e4m3 rows, `w2` as the K-major view `[E_local, I, H]`; scales fp32 in the
        interleaved row order.
    """
    from moe_ep.quant.layout import interleave_gate_up

    q13, s13 = quantize_weight_blocks(interleave_gate_up(w13, PULL_GATE_UP_BLOCK))
    q2, s2 = quantize_weight_blocks(w2)
    return Fp8BlockWeights(
        w13=q13.permute(0, 2, 1), w13_scales=s13, w2=q2.permute(0, 2, 1), w2_scales=s2
    )


def quantize_pull_pack(w13: torch.Tensor, w2: torch.Tensor) -> Any:
    """A pre-quantized `MoEWeightPack` in the pull kernel's grouping (use it with the config's
    `prequantized_fc1_gate_up_interleave=8`), e.g. to quantize once and store.

    Args:
        w13: `[E_local, 2I, H]` bf16/fp32, gate rows then up rows.
        w2: `[E_local, H, I]` bf16/fp32.

    Returns:
        e4m3 `w13` (gate-then-up rows) with fp32 `w13_scale [E_local, 2I/128, H/128]` taken
        over rows interleaved by 8; e4m3 `w2` with canonical 128x128 fp32 `w2_scale`.
    """
    from moe_ep.quant import deinterleave_gate_up, interleave_gate_up
    from moe_ep.types import MoEWeightPack

    q13, s13 = quantize_weight_blocks(interleave_gate_up(w13, PULL_GATE_UP_BLOCK))
    q2, s2 = quantize_weight_blocks(w2)
    return MoEWeightPack(
        w13=deinterleave_gate_up(q13, PULL_GATE_UP_BLOCK), w2=q2, w13_scale=s13, w2_scale=s2
    )


def pull_weights_from_pack(weights: Any, *, pack_fc1_interleave: int | None) -> Fp8BlockWeights:
    """A checked pre-quantized pack in the pull kernel's form (as `prepare_pull_weights`).

    The payload rows are interleaved by 8 (exact: a permutation of e4m3 bytes), then taken as
    K-major views; FC1 scales are used as given (paired pack) or regrouped from a canonical
    plane whose gate and up blocks agree (`common.fp8_packs.check_prequantized_pack`). Equal
    bit for bit to `prepare_pull_weights` of the weights the pack was quantized from.
    """
    from moe_ep.quant.layout import interleave_gate_up

    s13 = weights.w13_scale
    if pack_fc1_interleave is None:
        half = int(s13.shape[1]) // 2
        # paired block j covers gate rows [64j, 64j+64): canonical gate block j // 2
        s13 = s13[:, :half].repeat_interleave(2, dim=1)
    q13 = interleave_gate_up(weights.w13, PULL_GATE_UP_BLOCK)
    return Fp8BlockWeights(
        w13=q13.permute(0, 2, 1),
        w13_scales=aligned(s13),
        w2=aligned(weights.w2).permute(0, 2, 1),
        w2_scales=aligned(weights.w2_scale),
    )


def stage_pull_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
) -> StagedInputs:
    """Quantize and pad one rank's inputs into fresh pull-kernel staging buffers.

    Args:
        hidden_states: `[n, H]` bf16.
        topk_ids: `[n, k]` int32/int64 expert ids in `[-1, E)`; -1 = padded slot.
        topk_weights: `[n, k]` fp32.
        max_tokens: T, rows of the staged buffers (the kernel runs the whole buffer).
    """
    from moe_ep.quant.fp8 import quantize_fp8_blockwise

    n, h, _ = check_staging_inputs(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=FP8_BLOCK
    )
    dev = hidden_states.device
    cols = h // FP8_BLOCK
    activation = torch.zeros((max_tokens, h), dtype=torch.float8_e4m3fn, device=dev)
    scales = torch.zeros((max_tokens, ceil_to(cols, 4)), dtype=torch.float32, device=dev)
    if n:
        data, s = quantize_fp8_blockwise(hidden_states, block=(1, FP8_BLOCK), check_finite=False)
        activation[:n] = data
        scales[:n, :cols] = s
    ids, weights = stage_routing(topk_ids, topk_weights, max_tokens, ids_dtype=torch.int64)
    return StagedInputs(activation, scales, ids, weights, n)

"""The bf16 pull kernel's weights and staged inputs (pure torch, CPU or CUDA tensors alike).

What the drop's kernel reads (`moe_hopper_bf16/megamoe_kernel_bf16.py` `__call__`, its
reference `mega_reference_bf16.py` and runner): FC1 rows gate/up interleaved in blocks of 8
(its `Fp8GateUpInterleave`, the PostSwigluHalf fold shared with the fp8 kernel), passed as
the K-major view `fc1_weight [E_local, H, 2I]` (stride 1 along H) of the `[E_local, 2I, H]`
storage; `fc2_weight` the K-major view `[E_local, I, H]` of `w2 [E_local, H, I]`. No scale
planes. Staged activations are bf16 `[T, H]` (zero padding rows), ids int64 (-1 padded),
weights fp32 (0 wherever the id is -1). Glossary: `moe_ep_sm90.common.fp8_blockwise`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.backends.support.staging import check_staging_inputs, stage_routing
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.common.fp8_blockwise import StagedInputs, aligned
from moe_ep_sm90.common.pull_tiles import PULL_GATE_UP_BLOCK

__all__ = ["Bf16PullWeights", "prepare_bf16_pull_weights", "stage_bf16_pull_inputs"]

_ACT_BLOCK = 128
"""H multiple the stager asks (the config's geometry rules ask 256 before any launch)."""


@dataclass(frozen=True)
class Bf16PullWeights:
    """One rank's kernel-ready bf16 expert weights: `w13` the K-major view
    `[E_local, H, 2I]` of gate/up-interleaved rows, `w2` the K-major view `[E_local, I, H]`."""

    w13: torch.Tensor
    w2: torch.Tensor


def prepare_bf16_pull_weights(w13: torch.Tensor, w2: torch.Tensor) -> Bf16PullWeights:
    """Weights in the form the bf16 pull kernel reads.

    Args:
        w13: `[E_local, 2I, H]` bf16/fp32 (fp32 is rounded to bf16 once), gate rows then up.
        w2: `[E_local, H, I]` bf16/fp32.
    """
    from moe_ep.quant.layout import interleave_gate_up

    q13 = interleave_gate_up(w13.to(torch.bfloat16), PULL_GATE_UP_BLOCK)
    q2 = aligned(w2.to(torch.bfloat16))
    return Bf16PullWeights(w13=aligned(q13).permute(0, 2, 1), w2=q2.permute(0, 2, 1))


def stage_bf16_pull_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
) -> StagedInputs:
    """Pad one rank's inputs into fresh bf16 pull-kernel staging buffers.

    Args:
        hidden_states: `[n, H]` bf16 (the kernel's activation dtype; others are refused).
        topk_ids: `[n, k]` int32/int64 expert ids in `[-1, E)`; -1 = padded slot.
        topk_weights: `[n, k]` fp32.
        max_tokens: T, rows of the staged buffers (the kernel runs the whole buffer).
    """
    n, h, _ = check_staging_inputs(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=_ACT_BLOCK
    )
    if hidden_states.dtype != torch.bfloat16:
        raise MoeEpUsageError(f"hidden_states must be bfloat16, got {hidden_states.dtype}")
    activation = torch.zeros((max_tokens, h), dtype=torch.bfloat16, device=hidden_states.device)
    activation[:n] = hidden_states
    ids, weights = stage_routing(topk_ids, topk_weights, max_tokens, ids_dtype=torch.int64)
    return StagedInputs(activation, None, ids, weights, n)

"""Input checks and routing buffers every GPU kernel's stager shares (pure torch)."""

from __future__ import annotations

import torch

from moe_ep.errors import MoeEpUsageError

__all__ = ["check_staging_inputs", "stage_routing"]


def check_staging_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
    block: int,
) -> tuple[int, int, int]:
    """(n, H, k) of `[n, H]` inputs with `[n, k]` ids / weights; `MoeEpUsageError` unless
    n <= `max_tokens` and H is a multiple of the scale `block`."""
    if hidden_states.dim() != 2:
        raise MoeEpUsageError(f"hidden_states must be [n, H], got {tuple(hidden_states.shape)}")
    n, h = hidden_states.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n:
        raise MoeEpUsageError(f"topk_ids must be [n={n}, k], got {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (n, k):
        raise MoeEpUsageError(
            f"topk_weights must be [n, k] = [{n}, {k}], got {tuple(topk_weights.shape)}"
        )
    if n > max_tokens:
        raise MoeEpUsageError(f"hidden_states has n={n} rows, more than max_tokens={max_tokens}")
    if h % block:
        raise MoeEpUsageError(f"hidden_states.shape[1] (H) must be a multiple of {block}, got {h}")
    return n, h, k


def stage_routing(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    max_tokens: int,
    *,
    ids_dtype: torch.dtype = torch.int64,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[max_tokens, k]` ids of `ids_dtype` (-1 padded) and fp32 weights (0 wherever the id
    is -1 and on padding rows), on `device` (default: the ids' device)."""
    dev = topk_ids.device if device is None else device
    n, k = topk_ids.shape
    ids = torch.full((max_tokens, k), -1, dtype=ids_dtype, device=dev)
    weights = torch.zeros((max_tokens, k), dtype=torch.float32, device=dev)
    ids[:n] = topk_ids.to(ids_dtype)
    weights[:n] = torch.where(topk_ids >= 0, topk_weights.float(), 0.0)
    return ids, weights

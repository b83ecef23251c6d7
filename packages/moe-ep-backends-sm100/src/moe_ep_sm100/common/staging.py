"""Input checks and routing buffers shared by the nvfp4 and mxfp8 stagers."""

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
) -> tuple[int, int]:
    """(n, H) of `[n, H]` inputs with `[n, k]` ids / weights; `MoeEpUsageError` unless
    n <= `max_tokens` and H is a multiple of the scale `block`."""
    if hidden_states.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape:
        raise MoeEpUsageError(
            "hidden_states must be [n, H] and topk_ids / topk_weights [n, k], got "
            f"{list(hidden_states.shape)}, {list(topk_ids.shape)}, {list(topk_weights.shape)}"
        )
    n, h = hidden_states.shape
    if n > max_tokens or topk_ids.shape[0] != n:
        raise MoeEpUsageError(f"n={n} rows must match topk_ids and be <= max_tokens={max_tokens}")
    if h % block:
        raise MoeEpUsageError(f"H must be a multiple of {block}, got {h}")
    return n, h


def stage_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, max_tokens: int, *, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, k]` int64 ids (-1 padded) and fp32 weights (0 on padded slots and rows) on
    `device`."""
    dev, (n, k) = device, topk_ids.shape
    ids = torch.full((max_tokens, k), -1, dtype=torch.int64, device=dev)
    wts = torch.zeros((max_tokens, k), dtype=torch.float32, device=dev)
    ids[:n] = topk_ids.to(torch.int64)
    wts[:n] = torch.where(topk_ids >= 0, topk_weights.float(), 0.0)
    return ids, wts

"""Weights with one E8M0 scale byte per 32 elements along K (mxfp8, mxfp4): quantize a bf16 /
fp32 tensor, or check a pre-quantized (payload, scales) pack in canonical form."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moe_ep.errors import MoeEpUsageError

__all__ = ["E8M0_BLOCK", "e8m0_pack"]

E8M0_BLOCK = 32
"""Elements along K per E8M0 scale byte."""


def e8m0_pack(
    w: torch.Tensor,
    s: torch.Tensor | None,
    name: str,
    *,
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    payload_dtype: torch.dtype,
    payload_name: str,
    values_per_item: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(payload, scales as uint8)` of weight `name`: `quantize(w)` when `s` is None, else
    `w` and `s` after checking the payload dtype and the scale shape
    `[..., K / 32]` (K = last dim of `w` times `values_per_item`, 2 for packed fp4)."""
    if s is None:
        if w.dtype not in (torch.bfloat16, torch.float32):
            raise MoeEpUsageError(
                f"{name} must be bf16/fp32 (or {payload_name} with scales), got {w.dtype}"
            )
        return quantize(w)
    if w.dtype != payload_dtype:
        raise MoeEpUsageError(f"pre-quantized {name} must be {payload_name}, got {w.dtype}")
    expected = (*w.shape[:-1], w.shape[-1] * values_per_item // E8M0_BLOCK)
    if tuple(s.shape) != expected:
        raise MoeEpUsageError(
            f"{name}_scale must be {list(expected)} (one E8M0 byte per 32 along K), "
            f"got {list(s.shape)}"
        )
    return w, s.view(torch.uint8) if s.dtype != torch.uint8 else s

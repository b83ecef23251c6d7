"""What the two sm100 kernels with mxfp8 activations (mxfp8 x mxfp8, mxfp8 x mxfp4) lay out
alike (torch; CPU or CUDA tensors alike): E8M0-scaled weights in the form the CuTe DSL
kernels read, and the mxfp8 input staging. Each kernel's `layout` gives its own parameters
(gate/up block, scale-column padding, scale rule, id dtype)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from moe_ep.backends.support.launch_args import ceil_to
from moe_ep.backends.support.staging import check_staging_inputs, stage_routing
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.common.e8m0 import E8M0_BLOCK, e8m0_pack

__all__ = ["MxWeights", "StagedMxfp8Inputs", "prepare_mx_weights", "stage_mxfp8"]


@dataclass(frozen=True)
class MxWeights:
    """One rank's kernel-ready weights: payload K-major views `w13 [E_local, K, 2I]`,
    `w2 [E_local, I, H]` (K halved for packed e2m1; stride 1 on dim 1) and uint8 E8M0 scale
    planes 128x4-swizzled per expert, `[E_local, ceil128(N) * ceil4(K/32)]`."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def prepare_mx_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    *,
    gate_up_block: int,
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    payload_dtype: torch.dtype,
    payload_name: str,
    values_per_item: int = 1,
) -> MxWeights:
    """`MxWeights` of bf16/fp32 `w13 [E_local, 2I, H]` / `w2 [E_local, H, I]` (quantized by
    `quantize`), or of a pre-quantized pack (`payload_dtype` payloads, K divided by
    `values_per_item`, with canonical `[E_local, N, K/32]` E8M0 scales; `e8m0.e8m0_pack`):
    shapes checked (I a multiple of `gate_up_block`, H and I of 32), FC1's rows (data and
    scale rows alike) gate/up interleaved in blocks of `gate_up_block`, K-major views,
    swizzled scale planes."""
    from moe_ep.quant import interleave_gate_up, swizzle_128x4

    if w13.dim() != 3 or w2.dim() != 3:
        raise MoeEpUsageError("w13 and w2 must be 3-D: [E_local, 2I, H] and [E_local, H, I]")
    per_item = values_per_item if w13_scale is not None else 1
    e, two_i, h = w13.shape[0], w13.shape[1], w13.shape[2] * per_item
    i = two_i // 2
    want_w2 = (e, h, i // per_item)
    if tuple(w2.shape) != want_w2 or two_i % (2 * gate_up_block):
        halved = " (K halved for packed e2m1)" if values_per_item == 2 else ""
        raise MoeEpUsageError(
            f"w13 {list(w13.shape)} / w2 {list(w2.shape)} must be [E_local, 2I, H] / "
            f"[E_local, H, I]{halved} with I a multiple of {gate_up_block}; "
            f"w2 expected {list(want_w2)}"
        )
    if (w13_scale is None) != (w2_scale is None):
        raise MoeEpUsageError("w13_scale and w2_scale must be given together (or neither)")
    for name, k in (("H", h), ("I", i)):
        if k % E8M0_BLOCK:
            raise MoeEpUsageError(f"{name} must be a multiple of {E8M0_BLOCK}, got {k}")
    pack = partial(
        e8m0_pack,
        quantize=quantize,
        payload_dtype=payload_dtype,
        payload_name=payload_name,
        values_per_item=values_per_item,
    )
    (q13, s13), (q2, s2) = pack(w13, w13_scale, "w13"), pack(w2, w2_scale, "w2")
    w13 = interleave_gate_up(q13.view(torch.uint8), gate_up_block).view(q13.dtype)
    return MxWeights(
        w13=w13.permute(0, 2, 1),
        w13_scales=swizzle_128x4(interleave_gate_up(s13, gate_up_block)),
        w2=q2.contiguous().permute(0, 2, 1),
        w2_scales=swizzle_128x4(s2),
    )


@dataclass(frozen=True)
class StagedMxfp8Inputs:
    """Staged buffers of one launch; rows `>= num_tokens` are padding.

    `activation [T, H]` e4m3 (0 in padding rows), `activation_scales [T, C]` E8M0 bytes,
    linear, C = H/32 padded to the kernel's multiple (columns past H/32 and padding rows 0),
    `topk_ids [T, k]` in the kernel's dtype (-1 for masked slots and padding rows),
    `topk_weights [T, k]` fp32 (0 where the id is -1).
    """

    activation: torch.Tensor
    activation_scales: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int


def stage_mxfp8(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
    sf_column_multiple: int,
    normal_scales: bool,
    ids_dtype: torch.dtype,
) -> StagedMxfp8Inputs:
    """Quantize `[n, H]` bf16 inputs to mxfp8 (`quantize_mxfp8` with `normal_scales`) and pad
    them into fresh staging buffers of `max_tokens` rows, the scale plane's columns to a
    multiple of `sf_column_multiple`, the ids as `ids_dtype`."""
    from moe_ep.quant import quantize_mxfp8

    n, h, _ = check_staging_inputs(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=E8M0_BLOCK
    )
    dev = hidden_states.device
    cols = ceil_to(h // E8M0_BLOCK, sf_column_multiple)
    act = torch.zeros((max_tokens, h), dtype=torch.float8_e4m3fn, device=dev)
    sf = torch.zeros((max_tokens, cols), dtype=torch.uint8, device=dev)
    if n:
        data, scales = quantize_mxfp8(
            hidden_states, check_finite=False, normal_scales=normal_scales
        )
        act[:n] = data
        sf[:n, : h // E8M0_BLOCK] = scales
    ids, wts = stage_routing(topk_ids, topk_weights, max_tokens, ids_dtype=ids_dtype, device=dev)
    return StagedMxfp8Inputs(act, sf, ids, wts, n)

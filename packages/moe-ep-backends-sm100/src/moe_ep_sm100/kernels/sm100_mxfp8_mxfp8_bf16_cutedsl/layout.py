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

from dataclasses import dataclass

import torch

from moe_ep.backends.support.launch_args import ceil_to
from moe_ep.backends.support.staging import check_staging_inputs, stage_routing
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.common.e8m0 import e8m0_pack

__all__ = [
    "MXFP8_GATE_UP_BLOCK",
    "Mxfp8Weights",
    "StagedMxfp8Inputs",
    "prepare_mxfp8_weights",
    "stage_mxfp8_inputs",
]

MXFP8_GATE_UP_BLOCK = 32
_BLOCK = 32


@dataclass(frozen=True)
class Mxfp8Weights:
    """One rank's kernel-ready mxfp8 weights (see the module docstring for layouts)."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def _pack(w: torch.Tensor, s: torch.Tensor | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    from moe_ep.quant import quantize_mxfp8

    return e8m0_pack(
        w, s, name, quantize=quantize_mxfp8, payload_dtype=torch.float8_e4m3fn,
        payload_name="float8_e4m3fn",
    )  # fmt: skip


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
    from moe_ep.quant import interleave_gate_up, swizzle_128x4

    if w13.dim() != 3 or w2.dim() != 3:
        raise MoeEpUsageError("w13 and w2 must be 3-D: [E_local, 2I, H] and [E_local, H, I]")
    e, two_i, h = w13.shape
    if tuple(w2.shape) != (e, h, two_i // 2) or two_i % (2 * MXFP8_GATE_UP_BLOCK):
        raise MoeEpUsageError(
            f"w13 {list(w13.shape)} / w2 {list(w2.shape)} must be [E_local, 2I, H] / "
            f"[E_local, H, I] with I a multiple of {MXFP8_GATE_UP_BLOCK}"
        )
    if h % _BLOCK:
        raise MoeEpUsageError(f"H must be a multiple of {_BLOCK}, got {h}")
    q13, s13 = _pack(w13, w13_scale, "w13")
    q2, s2 = _pack(w2, w2_scale, "w2")
    q13 = interleave_gate_up(q13.view(torch.uint8), MXFP8_GATE_UP_BLOCK).view(q13.dtype)
    s13 = interleave_gate_up(s13, MXFP8_GATE_UP_BLOCK)
    return Mxfp8Weights(
        w13=q13.permute(0, 2, 1),
        w13_scales=swizzle_128x4(s13),
        w2=q2.permute(0, 2, 1),
        w2_scales=swizzle_128x4(s2),
    )


@dataclass(frozen=True)
class StagedMxfp8Inputs:
    """Staged buffers of one launch; rows `>= num_tokens` are padding.

    `activation [T, H]` e4m3 (0 in padding rows), `activation_scales [T, ceil4(H/32)]` E8M0
    bytes (columns past H/32 and padding rows 0), `topk_ids [T, k]` int64 (-1 for padded slots
    and rows), `topk_weights [T, k]` fp32 (0 where the id is -1).
    """

    activation: torch.Tensor
    activation_scales: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int


def stage_mxfp8_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
) -> StagedMxfp8Inputs:
    """Quantize and pad `[n, H]` bf16 inputs into fresh mxfp8 staging buffers of T rows."""
    from moe_ep.quant import quantize_mxfp8

    n, h, _ = check_staging_inputs(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=_BLOCK
    )
    dev = hidden_states.device
    act = torch.zeros((max_tokens, h), dtype=torch.float8_e4m3fn, device=dev)
    sf = torch.zeros((max_tokens, ceil_to(h // _BLOCK, 4)), dtype=torch.uint8, device=dev)
    if n:
        data, scales = quantize_mxfp8(hidden_states, check_finite=False)
        act[:n] = data
        sf[:n, : h // _BLOCK] = scales
    ids, wts = stage_routing(topk_ids, topk_weights, max_tokens, device=dev)
    return StagedMxfp8Inputs(act, sf, ids, wts, n)

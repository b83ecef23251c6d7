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

from dataclasses import dataclass

import torch

from moe_ep.backends.support.launch_args import ceil_to
from moe_ep.backends.support.staging import check_staging_inputs, stage_routing
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.common.e8m0 import e8m0_pack
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


@dataclass(frozen=True)
class Mxfp4Weights:
    """One rank's kernel-ready mxfp4 weights (see the module docstring for layouts): uint8
    packed e2m1 K-major views and uint8 E8M0 swizzled scale planes."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def _quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from moe_ep.quant import quantize_mxfp4

    return quantize_mxfp4(w, normal_scales=True)


def _pack(w: torch.Tensor, s: torch.Tensor | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    return e8m0_pack(
        w, s, name, quantize=_quantize_weight, payload_dtype=torch.uint8,
        payload_name="uint8 (packed e2m1)", values_per_item=2,
    )  # fmt: skip


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
    from moe_ep.quant import interleave_gate_up, swizzle_128x4

    if w13.dim() != 3 or w2.dim() != 3:
        raise MoeEpUsageError("w13 and w2 must be 3-D: [E_local, 2I, H] and [E_local, H, I]")
    per_item = 2 if w13_scale is not None else 1
    e, two_i, h = w13.shape[0], w13.shape[1], w13.shape[2] * per_item
    i = two_i // 2
    want_w2 = (e, h, i // per_item)
    if tuple(w2.shape) != want_w2 or two_i % (2 * GATE_UP_BLOCK):
        raise MoeEpUsageError(
            f"w13 {list(w13.shape)} / w2 {list(w2.shape)} must be [E_local, 2I, H] / "
            f"[E_local, H, I] (K halved for packed e2m1) with I a multiple of {GATE_UP_BLOCK}; "
            f"w2 expected {list(want_w2)}"
        )
    if (w13_scale is None) != (w2_scale is None):
        raise MoeEpUsageError("w13_scale and w2_scale must be given together (or neither)")
    for name, k in (("H", h), ("I", i)):
        if k % MX_BLOCK:
            raise MoeEpUsageError(f"{name} must be a multiple of {MX_BLOCK}, got {k}")
    q13, s13 = _pack(w13, w13_scale, "w13")
    q2, s2 = _pack(w2, w2_scale, "w2")
    return Mxfp4Weights(
        w13=interleave_gate_up(q13, GATE_UP_BLOCK).permute(0, 2, 1),
        w13_scales=swizzle_128x4(interleave_gate_up(s13, GATE_UP_BLOCK)),
        w2=q2.contiguous().permute(0, 2, 1),
        w2_scales=swizzle_128x4(s2),
    )


@dataclass(frozen=True)
class StagedMxfp8Inputs:
    """Staged buffers of one launch; rows `>= num_tokens` are padding.

    `activation [T, H]` e4m3 (0 in padding rows), `activation_scales [T, ceil16(H/32)]` E8M0
    bytes, linear (columns past H/32 and padding rows 0), `topk_ids [T, k]` int32 (-1 for
    masked slots and padding rows), `topk_weights [T, k]` fp32 (0 where the id is -1).
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
    """Quantize and pad `[n, H]` bf16 inputs into fresh mxfp8 staging buffers of
    `max_tokens` rows (`config.padded_tokens_per_rank`)."""
    from moe_ep.quant import quantize_mxfp8

    n, h, _ = check_staging_inputs(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=MX_BLOCK
    )
    dev = hidden_states.device
    act = torch.zeros((max_tokens, h), dtype=torch.float8_e4m3fn, device=dev)
    sf = torch.zeros((max_tokens, activation_sf_columns(h)), dtype=torch.uint8, device=dev)
    if n:
        data, scales = quantize_mxfp8(hidden_states, check_finite=False, normal_scales=True)
        act[:n] = data
        sf[:n, : h // MX_BLOCK] = scales
    ids, wts = stage_routing(topk_ids, topk_weights, max_tokens, ids_dtype=torch.int32, device=dev)
    return StagedMxfp8Inputs(act, sf, ids, wts, n)

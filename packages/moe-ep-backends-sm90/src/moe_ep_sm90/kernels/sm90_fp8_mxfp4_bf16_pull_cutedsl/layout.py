"""The sm90 MXFP4 x FP8 kernel's weights in its logical ABI (pure torch, CPU or CUDA).

Per leg (FC1 `w13`, FC2 `w2`), from mxfp4 (e2m1 codes, one E8M0 byte per 32 along K; ceil
rule when quantized here) after `moe_ep.quant.clamp_mxfp4_exponent_range` (11 binades per
expert, what the kernel's 4-bit offsets hold):

- `codes`: packed e2m1 `[E, N, K/2]` uint8, the clamped codes; FC1 rows gate/up
  interleaved in blocks of 8 (the kernel's `[pair, {gate, up}, 8]` fold).
- `offsets`: `[E, N, K/32]` uint8 in 1..12, `byte - min_byte(expert) + 1`: the kernel
  expands an e2m1 code to the e4m3 value `e2m1 * 2**(offset - 6)` (`mxfp4_cutedsl`'s PRMT
  lookup adds `offset` to the e4m3 exponent field).
- `residual64`: `[E]` fp32, `2**(min_byte - 127) * 0.5 * 64`, the per-expert factor the
  kernel folds into each row's activation scale (`0.5 * 2**6` undoes the `2**-6` above and
  e2m1's exponent bias), so `e4m3 * residual64` is the dequantized weight exactly, the values
  of the portable `any_fp8_mxfp4_bf16_torch` recipe.

Staged inputs (`stage_mxfp4_hybrid_inputs`): e4m3 activations with the per-token fp32
scale of `moe_ep.quant.quantize_fp8_per_token_hybrid` replicated over a 16-byte row
(`[T, 4]`, the drop's `sf_uint32_per_token = 4` for `mxfp4_hybrid`), int64 routing.

What the kernel reads (`Mxfp4PullLeg`, `mxfp4_pull_legs`): each leg's codes and offsets
folded into its physical tiles (`tile_fold`), the codes as the K-major view `[E, K/2, N]`,
the residual in the weight dequant-scale slot. Never run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep import quant
from moe_ep.backends.support.staging import check_staging_inputs, stage_routing
from moe_ep_sm90.common.fp8_blockwise import StagedInputs, aligned
from moe_ep_sm90.common.pull_tiles import PULL_GATE_UP_BLOCK
from moe_ep_sm90.common.tile_fold import (
    fold_codes,
    fold_offsets,
)

__all__ = [
    "HUMMING_COMPENSATION",
    "SCALE_WIRE_COLS",
    "Mxfp4HybridLeg",
    "Mxfp4PullLeg",
    "mxfp4_hybrid_leg",
    "mxfp4_pull_legs",
    "prepare_mxfp4_hybrid_weights",
    "stage_mxfp4_hybrid_inputs",
]

SCALE_WIRE_COLS = 4
"""fp32 words per token of the staged scale row: the one scale, replicated (16 bytes)."""

HUMMING_COMPENSATION = 64.0
"""`2**6`: the e4m3 expansion's exponent shift, undone in the per-expert residual."""


@dataclass(frozen=True)
class Mxfp4HybridLeg:
    """One GEMM's weights in the kernel's logical ABI (see the module doc)."""

    codes: torch.Tensor
    offsets: torch.Tensor
    residual64: torch.Tensor


def mxfp4_hybrid_leg(packed: torch.Tensor, scales: torch.Tensor) -> Mxfp4HybridLeg:
    """`packed [E, N, K/2]` e2m1 codes and `scales [E, N, K/32]` E8M0 bytes -> the leg."""
    codes, raised = quant.clamp_mxfp4_exponent_range(packed, scales.view(torch.uint8))
    e = int(raised.shape[0])
    low = raised.view(e, -1).amin(dim=1).to(torch.int32)  # max byte - range, by the clamp
    offsets = (raised.to(torch.int32) - low.view(e, 1, 1) + 1).to(torch.uint8)
    residual = torch.exp2(low.float() - 127.0) * 0.5 * HUMMING_COMPENSATION
    return Mxfp4HybridLeg(codes, offsets, residual)


def prepare_mxfp4_hybrid_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> tuple[Mxfp4HybridLeg, Mxfp4HybridLeg]:
    """(FC1, FC2) legs from bf16/fp32 weights (`w13 [E, 2I, H]`, `w2 [E, H, I]`, gate rows
    then up rows) or, with both scale planes, from a pre-quantized mxfp4 pack (`w13 [E, 2I,
    H/2]` uint8 codes, `w13_scale [E, 2I, H/32]` E8M0, likewise `w2`)."""
    legs = []
    for w, s in ((w13, w13_scale), (w2, w2_scale)):
        if s is None:
            w, s = quant.quantize_mxfp4(w)
        legs.append(mxfp4_hybrid_leg(w, s))
    fc1, fc2 = legs
    b = PULL_GATE_UP_BLOCK
    fc1 = Mxfp4HybridLeg(
        quant.interleave_gate_up(fc1.codes, b), quant.interleave_gate_up(fc1.offsets, b),
        fc1.residual64,
    )  # fmt: skip
    return fc1, fc2


@dataclass(frozen=True)
class Mxfp4PullLeg:
    """One GEMM's weights as the kernel takes them: `weight` the K-major view `[E, K/2, N]`
    (stride 1 on dim 1) of the physical codes `[E, N, K/2]` uint8, `offsets`
    `[E, N/64, K/128, 16, 16]` uint8 (`tile_fold`), `scale` `[E]` fp32, the residual64."""

    weight: torch.Tensor
    offsets: torch.Tensor
    scale: torch.Tensor


def mxfp4_pull_legs(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> tuple[Mxfp4PullLeg, Mxfp4PullLeg]:
    """(FC1, FC2) in the kernel's physical form, from the arguments of
    `prepare_mxfp4_hybrid_weights` (bf16/fp32 weights, or a pre-quantized mxfp4 pack)."""
    return tuple(  # type: ignore[return-value]
        Mxfp4PullLeg(
            weight=aligned(fold_codes(leg.codes)).permute(0, 2, 1),
            offsets=aligned(fold_offsets(leg.offsets)),
            scale=aligned(leg.residual64.float()),
        )
        for leg in prepare_mxfp4_hybrid_weights(w13, w2, w13_scale, w2_scale)
    )


def stage_mxfp4_hybrid_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
) -> StagedInputs:
    """Quantize and pad one rank's inputs into fresh staging buffers of T = `max_tokens` rows:
    `activation [T, H]` e4m3, `activation_scales [T, 4]` fp32 (padding rows zero), routing
    as `moe_ep.backends.support.staging.stage_routing` (int64 ids)."""
    n, h, _ = check_staging_inputs(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=128
    )
    dev = hidden_states.device
    activation = torch.zeros((max_tokens, h), dtype=torch.float8_e4m3fn, device=dev)
    scales = torch.zeros((max_tokens, SCALE_WIRE_COLS), dtype=torch.float32, device=dev)
    if n:
        data, s = quant.quantize_fp8_per_token_hybrid(hidden_states, check_finite=False)
        activation[:n] = data
        scales[:n] = s.expand(n, SCALE_WIRE_COLS)
    ids, weights = stage_routing(topk_ids, topk_weights, max_tokens, ids_dtype=torch.int64)
    return StagedInputs(activation, scales, ids, weights, n)

"""Kernel-ready fp8 blockwise weights and staged inputs for the two sm90 kernels (pure torch).

Everything here runs on CPU or CUDA tensors alike, so the layouts are tested on CPU and the
GPU launch path stages with these same functions.

Glossary: `n` tokens on this rank, `T` max tokens per rank (the staged buffer), `H` hidden,
`I` intermediate (after SwiGLU), `E_local` experts on this rank, `k` top-k.

Recipe (DeepSeek-V3 blockwise fp8, `moe_ep.quant.fp8`): e4m3 payload, fp32 scales
`amax / 448`, activations in 1x128 blocks, weights in 128x128 blocks, `x ~= payload * scale`.

- Pull kernel (`sm90_fp8_fp8_bf16_pull_cutedsl`): FC1 rows are gate/up interleaved in
  blocks of 8 *before* quantizing (its 128-row scale blocks run over interleaved rows, so
  scale block j covers gate rows and up rows `[64j, 64j + 64)`); weights are passed as
  K-major views `[E_local, K, N]` (K stride 1) of the `[E_local, N, K]` storage; staged
  activations are e4m3 with a `[T, ceil4(H/128)]` fp32 scale plane; token ids are int64.
  (The kernel quantizes its FC2 input itself, in 1x64 blocks: its drop's
  `Fp8Fc2ActivationScaleK`; the oracle's `fc2_act_block=64`.)
- Push kernel (`sm90_fp8_fp8_bf16_push_cuda`): FC1 keeps gate-then-up rows, weights stay
  `[E_local, N, K]` contiguous; activations are staged as bf16 (its dispatch quantizes
  them); token ids are int32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_ep.backends.support.args import ceil_to, check_pack_geometry
from moe_ep.checks import PackShape, check_weight_pack
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack

__all__ = [
    "PULL_GATE_UP_BLOCK",
    "Fp8BlockWeights",
    "StagedInputs",
    "check_pack",
    "prepare_pull_weights",
    "prepare_push_weights",
    "stage_pull_inputs",
    "stage_push_inputs",
]

PULL_GATE_UP_BLOCK = 8
_BLOCK = 128
_W_BLOCK = (_BLOCK, _BLOCK)


@dataclass(frozen=True)
class Fp8BlockWeights:
    """One rank's kernel-ready fp8 expert weights.

    `w13` / `w2` are the tensors handed to the kernel (see the module docstring for the
    per-kernel layout), `w13_scales` `[E_local, 2I/128, H/128]` and `w2_scales`
    `[E_local, H/128, I/128]` fp32, indexed in the row order of the stored weights.
    """

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def check_pack(
    kernel: str,
    weights: MoEWeightPack,
    fleet: FleetParams,
    world_size: int,
    config: Any,
    *,
    kernel_fc1_interleave: int | None = None,
) -> PackShape:
    """Checks of a `MoEWeightPack` against one of the sm90 fp8 kernels, before any collective.

    The generic pack checks (`check_weight_pack`: bf16/fp32 weights, which the kernel
    quantizes with its own recipe, or an e4m3 pre-quantized pack), then this format's rules:
    H and I multiples of 128; a pre-quantized pack must fit the kernel's recipe (`fp8_packs`:
    fp32 128x128 scales, FC1 scale grouping `kernel_fc1_interleave`, the pack's own grouping
    from the config's `prequantized_fc1_gate_up_interleave`, None without that field); the
    geometry must pass `config.check_problem` (top_k from the config, else 1).
    """
    shape = check_weight_pack(weights, fleet, world_size, quantized_dtypes=(torch.float8_e4m3fn,))
    for name, v in (("H", shape.hidden_size), ("I", shape.intermediate_size)):
        if v % _BLOCK:
            raise MoeEpUsageError(f"{kernel}: {name} must be a multiple of {_BLOCK}, got {v}")
    pack_interleave = getattr(config, "prequantized_fc1_gate_up_interleave", None)
    if not shape.prequantized and pack_interleave is not None:
        raise MoeEpUsageError(
            f"{kernel}: prequantized_fc1_gate_up_interleave={pack_interleave} describes a "
            f"pre-quantized pack, but the weights are {weights.w13.dtype} without scales "
            "(the kernel quantizes them with its own grouping): leave it None"
        )
    if shape.prequantized:
        from moe_ep_sm90.fp8_packs import check_prequantized_pack

        check_prequantized_pack(
            kernel,
            weights,
            pack_fc1_interleave=pack_interleave,
            kernel_fc1_interleave=kernel_fc1_interleave,
        )
    check_pack_geometry(config, fleet, world_size, shape)
    return shape


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from moe_ep.quant.fp8 import quantize_fp8_blockwise

    return quantize_fp8_blockwise(w, block=_W_BLOCK, dtype=torch.float8_e4m3fn)


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

    q13, s13 = _quantize(interleave_gate_up(w13, PULL_GATE_UP_BLOCK))
    q2, s2 = _quantize(w2)
    return Fp8BlockWeights(
        w13=q13.permute(0, 2, 1), w13_scales=s13, w2=q2.permute(0, 2, 1), w2_scales=s2
    )


def prepare_push_weights(w13: torch.Tensor, w2: torch.Tensor) -> Fp8BlockWeights:
    """Weights in the form the push kernel reads: contiguous `[E_local, N, K]` e4m3 (gate, up)."""
    q13, s13 = _quantize(w13)
    q2, s2 = _quantize(w2)
    return Fp8BlockWeights(w13=q13, w13_scales=s13, w2=q2, w2_scales=s2)


@dataclass(frozen=True)
class StagedInputs:
    """The staged buffers of one launch; rows `>= num_tokens` are padding.

    `activation [T, H]`: e4m3 (pull) or bf16 (push), zero in padding rows.
    `activation_scales [T, ceil4(H/128)]` fp32 (pull only, else None): the first `H/128`
    columns are the 1x128 block scales, the rest zero (16-byte TMA rows).
    `topk_ids [T, k]`: int64 (pull) or int32 (push); -1 for padded slots and padding rows.
    `topk_weights [T, k]` fp32, 0 wherever the id is -1.
    """

    activation: torch.Tensor
    activation_scales: torch.Tensor | None
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int


def _check_inputs(
    hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, t: int
) -> tuple[int, int, int]:
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
    if n > t:
        raise MoeEpUsageError(f"hidden_states has n={n} rows, more than max_tokens={t}")
    if h % _BLOCK:
        raise MoeEpUsageError(f"hidden_states.shape[1] (H) must be a multiple of {_BLOCK}, got {h}")
    return n, h, k


def _stage_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, t: int, ids_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = topk_ids.shape
    ids = torch.full((t, k), -1, dtype=ids_dtype, device=topk_ids.device)
    weights = torch.zeros((t, k), dtype=torch.float32, device=topk_ids.device)
    ids[:n] = topk_ids.to(ids_dtype)
    weights[:n] = torch.where(topk_ids >= 0, topk_weights.float(), 0.0)
    return ids, weights


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

    n, h, _ = _check_inputs(hidden_states, topk_ids, topk_weights, max_tokens)
    dev = hidden_states.device
    cols = h // _BLOCK
    activation = torch.zeros((max_tokens, h), dtype=torch.float8_e4m3fn, device=dev)
    scales = torch.zeros((max_tokens, ceil_to(cols, 4)), dtype=torch.float32, device=dev)
    if n:
        data, s = quantize_fp8_blockwise(hidden_states, block=(1, _BLOCK), check_finite=False)
        activation[:n] = data
        scales[:n, :cols] = s
    ids, weights = _stage_routing(topk_ids, topk_weights, max_tokens, torch.int64)
    return StagedInputs(activation, scales, ids, weights, n)


def stage_push_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
) -> StagedInputs:
    """Pad one rank's inputs into fresh push-kernel staging buffers (bf16, int32 ids)."""
    n, h, _ = _check_inputs(hidden_states, topk_ids, topk_weights, max_tokens)
    activation = torch.zeros((max_tokens, h), dtype=torch.bfloat16, device=hidden_states.device)
    activation[:n] = hidden_states
    ids, weights = _stage_routing(topk_ids, topk_weights, max_tokens, torch.int32)
    return StagedInputs(activation, None, ids, weights, n)

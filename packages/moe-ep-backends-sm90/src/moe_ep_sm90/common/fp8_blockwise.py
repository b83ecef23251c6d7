"""The fp8 blockwise pieces both sm90 kernels share (pure torch, CPU or CUDA tensors alike).

Glossary: `n` tokens on this rank, `T` max tokens per rank (the staged buffer), `H` hidden,
`I` intermediate (after SwiGLU), `E_local` experts on this rank, `k` top-k.

Recipe (DeepSeek-V3 blockwise fp8, `moe_ep.quant.fp8`): e4m3 payload, fp32 scales
`amax / 448`, activations in 1x128 blocks, weights in 128x128 blocks, `x ~= payload * scale`.
Each kernel's own layout (`<kernel>/layout.py`) builds on these: the weight record, the
128x128 weight quantizer, the staged-input record, the input checks and the routing buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.common.config import FP8_BLOCK

__all__ = [
    "Fp8BlockWeights",
    "StagedInputs",
    "aligned",
    "check_staging_inputs",
    "quantize_weight_blocks",
    "stage_routing",
]


@dataclass(frozen=True)
class Fp8BlockWeights:
    """One rank's kernel-ready fp8 expert weights.

    `w13` / `w2` are the tensors handed to the kernel (each kernel's `layout` module says
    its layout), `w13_scales` `[E_local, 2I/128, H/128]` and `w2_scales`
    `[E_local, H/128, I/128]` fp32, indexed in the row order of the stored weights.
    """

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 payload, fp32 scales) of `w` in 128x128 blocks over its last two dims."""
    from moe_ep.quant.fp8 import quantize_fp8_blockwise

    return quantize_fp8_blockwise(w, block=(FP8_BLOCK, FP8_BLOCK), dtype=torch.float8_e4m3fn)


def aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with a 16-byte aligned data pointer (a copy only where needed).

    The kernels take these tensors with an assumed 16-byte alignment (TMA); a pack sliced to
    one rank's experts starts mid-allocation, e.g. `w2_scale [E, 9, 3]` fp32 (108 bytes an
    expert) from an odd expert on. The drop's own runner clones such views too."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


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


def check_staging_inputs(
    hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, t: int
) -> tuple[int, int, int]:
    """(n, H, k) of `[n, H]` inputs with `[n, k]` ids / weights; `MoeEpUsageError` unless
    n <= `t` and H is a multiple of 128."""
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
    if h % FP8_BLOCK:
        raise MoeEpUsageError(
            f"hidden_states.shape[1] (H) must be a multiple of {FP8_BLOCK}, got {h}"
        )
    return n, h, k


def stage_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, t: int, ids_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`[t, k]` ids of `ids_dtype` (-1 padded) and fp32 weights (0 wherever the id is -1)."""
    n, k = topk_ids.shape
    ids = torch.full((t, k), -1, dtype=ids_dtype, device=topk_ids.device)
    weights = torch.zeros((t, k), dtype=torch.float32, device=topk_ids.device)
    ids[:n] = topk_ids.to(ids_dtype)
    weights[:n] = torch.where(topk_ids >= 0, topk_weights.float(), 0.0)
    return ids, weights

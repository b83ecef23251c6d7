"""The fp8 blockwise pieces both sm90 kernels share (pure torch, CPU or CUDA tensors alike).

Glossary: `n` tokens on this rank, `T` max tokens per rank (the staged buffer), `H` hidden,
`I` intermediate (after SwiGLU), `E_local` experts on this rank, `k` top-k.

Recipe (DeepSeek-V3 blockwise fp8, `moe_ep.quant.fp8`): e4m3 payload, fp32 scales
`amax / 448`, activations in 1x128 blocks, weights in 128x128 blocks, `x ~= payload * scale`.
Each kernel's own layout (`<kernel>/layout.py`) builds on these: the weight record, the
128x128 weight quantizer and the staged-input record (the input checks and routing buffers
every GPU stager shares are `moe_ep.backends.support.staging`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep_sm90.common.config import FP8_BLOCK

__all__ = [
    "Fp8BlockWeights",
    "StagedInputs",
    "aligned",
    "quantize_weight_blocks",
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

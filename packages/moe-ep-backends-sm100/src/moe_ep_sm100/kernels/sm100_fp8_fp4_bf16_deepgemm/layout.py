"""Kernel-ready weights and staged inputs of `sm100_fp8_fp4_bf16_deepgemm` (torch, CPU or CUDA).

Recipe (DeepGEMM's `recipe=(1, 1, 32)`, `mma_type="fp8xfp4"`):
- weights mxfp4: e2m1 codes, two per byte with the even element in the low nibble, one UE8M0
  (E8M0) scale per 32 elements along K, ceil rule (`moe_ep.quant.quantize_mxfp4`; the same
  bytes DeepGEMM's `per_token_cast_to_fp4(use_ue8m0=True, gran_k=32)` gives, up to its
  tie-breaking, which only matters for who quantizes; the kernel reads any codes);
- activations e4m3 with one UE8M0 scale per 1x32 block along K, ceil rule
  (`moe_ep.quant.quantize_mxfp8`: the power of two 2**ceil(log2(amax / 448)), i.e.
  DeepGEMM's `per_token_cast_to_fp8(use_ue8m0=True, gran_k=32)`). The kernel quantizes the
  FC2 input (the SwiGLU output, top-k weight applied first) the same way.

Kernel layout (what `deep_gemm.transform_weights_for_mega_moe` applied to
`transform_sf_into_required_layout(sf, n, k, (1, 32), E)` output produces; written here from
the reading listed in docs/backends.md, nothing copied):
- `w13 [E_local, 2I, H/2]` int8 (packed e2m1, K-major, contiguous), rows gate/up interleaved
  in blocks of 8: `g[0:8], u[0:8], g[8:16], ...`;
- `w2 [E_local, H, I/2]` int8, rows as given;
- scales `[E_local, N, K/128]` int32: four UE8M0 bytes per int (byte j, little-endian, is the
  scale of K-block 4c + j); MN-major (strides `(N * K/128, 1, N)`); rows permuted within
  every 128-row group for the tensor memory copy (UTCCP): kernel row `4 * j + i` holds row
  `32 * i + j` (i < 4, j < 32); FC1 scale rows interleaved like the FC1 weights first.

Staging (`SymmBuffer` views of the API): `x [T, H]` e4m3, `x_sf [T, H/128]` int32 packed
UE8M0 (K-major, row-major), `topk_idx [T, k]` int64 (-1 = padded slot), `topk_weights
[T, k]` fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.backends.support.staging import check_staging_inputs, stage_routing
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.common.e8m0 import E8M0_BLOCK, e8m0_pack

__all__ = [
    "DEEPGEMM_GATE_UP_BLOCK",
    "DEEPGEMM_SF_BLOCK",
    "UTCCP_ROWS",
    "DeepgemmWeights",
    "StagedDeepgemmInputs",
    "pack_ue8m0",
    "prepare_deepgemm_weights",
    "stage_deepgemm_inputs",
    "utccp_rows",
]

DEEPGEMM_GATE_UP_BLOCK = 8
"""FC1 gate/up row interleave of the mega-MoE (`_interleave_weights(gran=8)` upstream)."""
DEEPGEMM_SF_BLOCK = E8M0_BLOCK
"""Elements along K per UE8M0 scale, weights and activations."""
UTCCP_ROWS = 128
"""Rows per group of the UTCCP scale-row permutation."""
_PACK = 4  # UE8M0 bytes per int32


@dataclass(frozen=True)
class DeepgemmWeights:
    """One rank's kernel-ready fp4 weights (layouts in the module docstring).

    w13: `[E_local, 2I, H/2]` int8, gate/up interleaved by 8. w13_scales: `[E_local, 2I, H/128]`
    int32, MN-major, UTCCP rows. w2: `[E_local, H, I/2]` int8. w2_scales: `[E_local, H, I/128]`.
    """

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """`[..., K/32]` uint8 UE8M0 bytes -> `[..., K/128]` int32, byte j of int c = block 4c+j.

    Little-endian byte order (every CUDA host); K/32 must be a multiple of 4.
    """
    if scales.dtype != torch.uint8 or scales.shape[-1] % _PACK:
        raise MoeEpUsageError(
            f"scales must be uint8 [..., K/32] with K/32 a multiple of 4, got {scales.dtype} "
            f"{list(scales.shape)}"
        )
    return scales.contiguous().view(torch.int32)


def _check_rows(t: torch.Tensor) -> tuple[int, int, int]:
    e, n, c = t.shape
    if n % UTCCP_ROWS:
        raise MoeEpUsageError(f"scale rows must be a multiple of {UTCCP_ROWS}, got {n}")
    return e, n, c


def utccp_rows(sf: torch.Tensor) -> torch.Tensor:
    """`[E, N, C]` -> same shape, row `4j + i` of each 128-row group = input row `32i + j`."""
    e, n, c = _check_rows(sf)
    return sf.reshape(e, n // UTCCP_ROWS, 4, 32, c).transpose(2, 3).reshape(e, n, c)


def _mn_major(t: torch.Tensor) -> torch.Tensor:
    """`[E, N, C]` with strides `(N * C, 1, N)` (the kernel's TMA-aligned MN-major SF).

    Explicit strides: `.contiguous()` would keep a stride of 1 on a size-1 dim (C == 1),
    which the kernel's layout check refuses."""
    e, n, c = t.shape
    out = torch.empty_strided((e, n, c), (n * c, 1, n), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _pack(w: torch.Tensor, s: torch.Tensor | None, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    from moe_ep.quant import quantize_mxfp4

    return e8m0_pack(
        w, s, name, quantize=quantize_mxfp4, payload_dtype=torch.uint8,
        payload_name="packed mxfp4 uint8", values_per_item=2,
    )  # fmt: skip


def _kernel_scales(s: torch.Tensor) -> torch.Tensor:
    return _mn_major(utccp_rows(pack_ue8m0(s)))


def prepare_deepgemm_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> DeepgemmWeights:
    """Weights in the form `deep_gemm.fp8_fp4_mega_moe` reads (see the module docstring).

    Args:
        w13: `[E_local, 2I, H]` gate rows then up rows, bf16/fp32; or packed mxfp4
            `[E_local, 2I, H/2]` uint8 with `w13_scale [E_local, 2I, H/32]` E8M0 bytes
            (canonical: unswizzled, unpacked, gate-then-up).
        w2: `[E_local, H, I]`, likewise with `w2_scale [E_local, H, I/32]`.
        H and I must be multiples of 128 (UTCCP groups and 4 scales per int).
    """
    from moe_ep.quant import interleave_gate_up

    if w13.dim() != 3 or w2.dim() != 3:
        raise MoeEpUsageError("w13 and w2 must be 3-D: [E_local, 2I, H] and [E_local, H, I]")
    q13, s13 = _pack(w13, w13_scale, "w13")
    q2, s2 = _pack(w2, w2_scale, "w2")
    e, two_i, h_half = q13.shape
    h, i = 2 * h_half, two_i // 2
    if tuple(q2.shape) != (e, h, i // 2) or h % 128 or i % 128:
        raise MoeEpUsageError(
            f"w13 {list(w13.shape)} / w2 {list(w2.shape)} must be [E_local, 2I, H] / "
            "[E_local, H, I] (last dims halved when packed) with H and I multiples of 128"
        )
    b = DEEPGEMM_GATE_UP_BLOCK
    return DeepgemmWeights(
        w13=interleave_gate_up(q13, b).view(torch.int8),
        w13_scales=_kernel_scales(interleave_gate_up(s13, b)),
        w2=q2.contiguous().view(torch.int8),
        w2_scales=_kernel_scales(s2),
    )


@dataclass(frozen=True)
class StagedDeepgemmInputs:
    """Staged inputs of one launch; rows `>= num_tokens` are padding.

    `activation [T, H]` e4m3 (0 in padding rows), `activation_scales [T, H/128]` int32 packed
    UE8M0 (0 in padding rows), `topk_ids [T, k]` int64 (-1 for padded slots and rows),
    `topk_weights [T, k]` fp32 (0 where the id is -1).
    """

    activation: torch.Tensor
    activation_scales: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int


def stage_deepgemm_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
) -> StagedDeepgemmInputs:
    """Quantize and pad `[n, H]` bf16 inputs into fresh staging tensors of T = `max_tokens`
    rows (the bytes the kernel's `SymmBuffer` input views receive)."""
    from moe_ep.quant import quantize_mxfp8

    n, h, _ = check_staging_inputs(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=128
    )
    dev = hidden_states.device
    act = torch.zeros((max_tokens, h), dtype=torch.float8_e4m3fn, device=dev)
    sf = torch.zeros((max_tokens, h // 128), dtype=torch.int32, device=dev)
    if n:
        data, scales = quantize_mxfp8(hidden_states, check_finite=False)
        act[:n] = data
        sf[:n] = pack_ue8m0(scales)
    ids, wts = stage_routing(topk_ids, topk_weights, max_tokens, device=dev)
    return StagedDeepgemmInputs(act, sf, ids, wts, n)

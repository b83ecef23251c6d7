"""The sm90 NVFP4 x FP8 kernel's weights in its logical ABI, and its staged inputs (pure
torch, CPU or CUDA).

Per leg (FC1 `w13 [E, 2I, H]`, FC2 `w2 [E, H, I]`), from nvfp4 (e2m1 codes, element 2i in
the low nibble; one e4m3 scale per 16 along K; one fp32 decode scale G per expert, the
weight being `G * e2m1 * scale`), quantized here from bf16/fp32 weights by the portable
twin's rule (`moe_ep.quant.nvfp4_decode_scale`, `quantize_nvfp4_decode_scaled`) or taken
from a pre-quantized pack:

1. K permutation `nvfp4_kperm` (0: none; 32 / 64: inside every K32 / K64 chunk, `kperm_index`)
   of the codes along K; for FC1 also of the gate rows and of the up rows (each half on its
   own), payload and scales, so that FC1's output, FC2's K, is in the order of FC2's
   permuted K. The staged activations get the same permutation of H (`stage_nvfp4_inputs`).
2. FC1 rows gate/up-interleaved in blocks of 8 (`PULL_GATE_UP_BLOCK`), payload and scales.
3. With a K permutation, the scales of rows `16q + g` and `16q + 8 + g` (g < 8) trade the
   odd K16 scale of each pair for the even one: `S[16q+g, 2t+1] <-> S[16q+8+g, 2t]`
   (`swap_scale_pairs`), so a 16-bit scale load serves one K16 scale of two rows.
4. Scales folded per 64 rows x 128 K into 32 x 16 bytes (`fold_scales`): the byte of row
   `64b + 16m1 + m0`, K16 group `8c + 2g1 + g0` sits at block `(b, c)` offset
   `((4 m1 + g1) 16 + m0) 2 + g0`, i.e. `[E, N/64, K/128, 32, 16]`.
5. `decode_x8 = 8 * G` per expert: the kernel's operand is `RN_E4M3(e2m1 * scale / 8)` and its
   epilogue multiplies by this (`quant.NVFP4_EPILOGUE_COMPENSATION`).
6. The payload in the kernel's physical tiles (`nvfp4_pull_legs`): the MXFP4 kernel's
   (`common.tile_fold.fold_codes`), as a K-major `[E, K/2, N]`
   view. The NVFP4 conversion loads the packed stage with the MXFP4 kernel's LDSM views
   (`nvfp4_conversion` imports them: "Packed payload layout is identical to MXFP4") and takes
   byte t's sign as the MXFP4 PTX does (`src & 0x80808080` into bytes 0-3, `src << 4` into
   bytes 4-7, magnitudes from `src & 0x77777777`), so the same fold serves.

Read from FlashInfer 0.7.4 (`fp8_nvfp4_bf16_pull_cutedsl/weights.py`, `shim/nvfp4_*.py`),
restated here from their definitions. Never run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep import quant
from moe_ep.backends.support.staging import check_staging_inputs
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import MoEWeightPack
from moe_ep_sm90.common.fp8_blockwise import StagedInputs, aligned
from moe_ep_sm90.common.pull_tiles import PULL_GATE_UP_BLOCK
from moe_ep_sm90.common.tile_fold import fold_codes
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.layout import stage_mxfp4_hybrid_inputs
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config import NVFP4_KPERM_CHOICES

__all__ = [
    "Nvfp4Leg",
    "Nvfp4PullLeg",
    "fold_scales",
    "kperm_index",
    "nvfp4_leg",
    "nvfp4_pull_legs",
    "prepare_nvfp4_weights",
    "stage_nvfp4_inputs",
    "swap_scale_pairs",
    "unfold_scales",
    "unprepare_nvfp4_leg",
]

_FOLD_M = 64


@dataclass(frozen=True)
class Nvfp4Leg:
    """One GEMM's weights in the kernel's logical ABI (steps 1-5 of the module doc).

    `payload [E, N, K/2]` uint8 codes in logical order (not yet the physical LDSM order);
    `scales [E, N/64, K/128, 32, 16]` uint8 e4m3 bytes, folded; `decode_x8 [E]` fp32."""

    payload: torch.Tensor
    scales: torch.Tensor
    decode_x8: torch.Tensor


@dataclass(frozen=True)
class Nvfp4PullLeg:
    """One GEMM's launch tensors: `weight [E, K/2, N]` uint8 (the physical tiles, K-major:
    stride 1 on dim 1), `scales [E, N/64, K/128, 32, 16]` uint8, `decode_x8 [E]` fp32 (the
    weight dequant-scale slot); each 16-byte aligned."""

    weight: torch.Tensor
    scales: torch.Tensor
    decode_x8: torch.Tensor


def kperm_index(length: int, kperm: int, *, device: torch.device | None = None) -> torch.Tensor:
    """Gather index of the K permutation: `permuted = natural[..., kperm_index(...)]`.

    Inside each chunk of `kperm` elements, position p takes element `pi(p)`:
    kperm 32: `p = 16h + 8a + 4b + j -> 16a + 8b + 4h + j`;
    kperm 64: `p = 32i + 16h + 4c + j -> 16c + 8i + 4h + j` (the identity for kperm 0).
    """
    if kperm not in NVFP4_KPERM_CHOICES:
        raise MoeEpUsageError(f"kperm must be one of {NVFP4_KPERM_CHOICES}, got {kperm!r}")
    p = torch.arange(length, device=device)
    if kperm == 0:
        return p
    if length % kperm:
        raise MoeEpUsageError(f"a K-permuted length must be a multiple of {kperm}, got {length}")
    base, r = p - p % kperm, p % kperm
    j = r % 4
    if kperm == 32:
        h, a, b = r // 16, r // 8 % 2, r // 4 % 2
        return base + 16 * a + 8 * b + 4 * h + j
    i, h, c = r // 32, r // 16 % 2, r // 4 % 4
    return base + 16 * c + 8 * i + 4 * h + j


def _permute(t: torch.Tensor, dim: int, kperm: int, *, inverse: bool = False) -> torch.Tensor:
    if kperm == 0:
        return t
    index = kperm_index(int(t.shape[dim]), kperm, device=t.device)
    if inverse:
        index = torch.argsort(index)
    return t.index_select(dim, index)


def _permute_codes(packed: torch.Tensor, kperm: int, *, inverse: bool = False) -> torch.Tensor:
    """Packed e2m1 `[..., K/2]` with the codes' K order permuted."""
    if kperm == 0:
        return packed
    codes = _permute(quant.unpack_e2m1(packed), -1, kperm, inverse=inverse)
    return quant.pack_e2m1(codes.contiguous())


def _permute_halves(t: torch.Tensor, kperm: int, *, inverse: bool = False) -> torch.Tensor:
    """FC1 `[E, 2I, ...]`: the gate rows and the up rows each permuted (step 1)."""
    e, rows = int(t.shape[0]), int(t.shape[1])
    halves = t.reshape(e, 2, rows // 2, *t.shape[2:])
    return _permute(halves, 2, kperm, inverse=inverse).reshape(t.shape)


def swap_scale_pairs(scales: torch.Tensor) -> torch.Tensor:
    """Step 3 on `[E, N, K/16]` (N % 16, K/16 % 2 == 0); its own inverse."""
    e, n, groups = (int(d) for d in scales.shape)
    v = scales.reshape(e, n // 16, 2, 8, groups // 2, 2)  # (E, q, s, g, t, u)
    return v.permute(0, 1, 5, 3, 4, 2).reshape(e, n, groups).contiguous()


def fold_scales(scales: torch.Tensor) -> torch.Tensor:
    """Step 4: `[E, N, K/16]` (N % 64, K % 128 == 0) -> `[E, N/64, K/128, 32, 16]`."""
    e, n, groups = (int(d) for d in scales.shape)
    v = scales.reshape(e, n // _FOLD_M, 4, 16, groups // 8, 4, 2)  # (E, b, m1, m0, c, g1, g0)
    folded = v.permute(0, 1, 4, 2, 5, 3, 6).contiguous()
    return folded.reshape(e, n // _FOLD_M, groups // 8, 32, 16)


def unfold_scales(folded: torch.Tensor) -> torch.Tensor:
    """Inverse of `fold_scales`."""
    e, nb, kb = (int(d) for d in folded.shape[:3])
    v = folded.reshape(e, nb, kb, 4, 4, 16, 2)  # (E, b, c, m1, g1, m0, g0)
    return v.permute(0, 1, 3, 5, 2, 4, 6).reshape(e, nb * _FOLD_M, kb * 8).contiguous()


def nvfp4_leg(
    payload: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor | None,
    *,
    kperm: int,
    fc1: bool,
    name: str,
) -> Nvfp4Leg:
    """One pre-quantized leg (`payload [E, N, K/2]` uint8, `scales [E, N, K/16]` e4m3 or its
    bytes, G `[E]` or one value fp32, None = 1) -> the kernel's logical ABI (module doc,
    steps 1-5). The pack's values are checked by the kernel's `validate_weights` (the
    portable twin's pack checks); this checks only that the planes fit together."""
    e, n, half_k = (int(d) for d in payload.shape)
    if tuple(scales.shape) != (e, n, 2 * half_k // 16):
        raise MoeEpUsageError(
            f"{name}_scale must have shape {(e, n, 2 * half_k // 16)} (one e4m3 scale per 16 "
            f"of K of {name} {tuple(payload.shape)}), got {tuple(scales.shape)}"
        )
    raw = scales.view(torch.uint8)
    g = torch.ones(e, dtype=torch.float32, device=payload.device)
    if global_scale is not None:
        g = g * global_scale.to(device=payload.device, dtype=torch.float32).reshape(-1)
    codes = _permute_codes(payload, kperm)
    if fc1:
        codes, raw = _permute_halves(codes, kperm), _permute_halves(raw, kperm)
        codes = quant.interleave_gate_up(codes, PULL_GATE_UP_BLOCK)
        raw = quant.interleave_gate_up(raw, PULL_GATE_UP_BLOCK)
    if kperm:
        raw = swap_scale_pairs(raw)
    return Nvfp4Leg(codes.contiguous(), fold_scales(raw), g * quant.NVFP4_EPILOGUE_COMPENSATION)


def unprepare_nvfp4_leg(leg: Nvfp4Leg, *, kperm: int, fc1: bool) -> tuple[torch.Tensor, ...]:
    """Inverse of `nvfp4_leg`: `(payload, scale bytes, G)` in the canonical pack layout."""
    raw = unfold_scales(leg.scales)
    if kperm:
        raw = swap_scale_pairs(raw)
    codes = leg.payload
    if fc1:
        codes = quant.deinterleave_gate_up(codes, PULL_GATE_UP_BLOCK)
        raw = quant.deinterleave_gate_up(raw, PULL_GATE_UP_BLOCK)
        codes = _permute_halves(codes, kperm, inverse=True)
        raw = _permute_halves(raw, kperm, inverse=True)
    codes = _permute_codes(codes, kperm, inverse=True)
    return codes, raw, leg.decode_x8 / quant.NVFP4_EPILOGUE_COMPENSATION


def prepare_nvfp4_weights(weights: MoEWeightPack, *, kperm: int) -> tuple[Nvfp4Leg, Nvfp4Leg]:
    """(FC1, FC2) legs from bf16/fp32 weights (`w13 [E, 2I, H]`, `w2 [E, H, I]`, gate rows
    then up rows; quantized with one decode scale G per expert and leg) or, with both scale
    planes, from a pre-quantized nvfp4 pack (`w13 [E, 2I, H/2]`, `w2 [E, H, I/2]` uint8 codes,
    `w13_scale [E, 2I, H/16]`, `w2_scale [E, H, I/16]` e4m3, G `[E]` fp32 or None = 1)."""
    legs = []
    for name, fc1 in (("w13", True), ("w2", False)):
        w, s = getattr(weights, name), getattr(weights, f"{name}_scale")
        g = getattr(weights, f"{name}_global_scale")
        if s is None:
            g = quant.nvfp4_decode_scale(w, dim=(-2, -1))
            w, s = quant.quantize_nvfp4_decode_scaled(w, decode_scale=g)
        legs.append(nvfp4_leg(w, s, g, kperm=kperm, fc1=fc1, name=name))
    return legs[0], legs[1]


def nvfp4_pull_legs(weights: MoEWeightPack, *, kperm: int) -> tuple[Nvfp4PullLeg, Nvfp4PullLeg]:
    """(FC1, FC2) in the kernel's physical form (step 6), from what `prepare_nvfp4_weights`
    takes."""
    fc1, fc2 = (
        Nvfp4PullLeg(
            weight=aligned(fold_codes(leg.payload)).permute(0, 2, 1),
            scales=aligned(leg.scales),
            decode_x8=aligned(leg.decode_x8.float()),
        )
        for leg in prepare_nvfp4_weights(weights, kperm=kperm)
    )
    return fc1, fc2


def stage_nvfp4_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
    kperm: int,
) -> StagedInputs:
    """The MXFP4 kernel's staging (`stage_mxfp4_hybrid_inputs`: e4m3 rows, the per-token fp32
    scale on a `[T, 4]` row, int64 routing) with the activation's H in `kperm` order (a
    permutation inside K64 chunks leaves each token's amax, so its scale, unchanged)."""
    check_staging_inputs(hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=128)
    staged = stage_mxfp4_hybrid_inputs(hidden_states, topk_ids, topk_weights, max_tokens=max_tokens)
    if kperm and staged.num_tokens:
        n = staged.num_tokens
        rows = staged.activation[:n].view(torch.uint8)
        staged.activation[:n].view(torch.uint8).copy_(_permute(rows, 1, kperm))
    return staged

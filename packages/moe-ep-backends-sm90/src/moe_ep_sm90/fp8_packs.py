"""Pre-quantized fp8 weight packs for the two sm90 kernels (pure torch, CPU or CUDA).

A pre-quantized `MoEWeightPack` holds e4m3 payloads `w13 [E_local, 2I, H]` (gate rows then
up rows) / `w2 [E_local, H, I]` and fp32 scale planes `w13_scale [E_local, 2I/128, H/128]` /
`w2_scale [E_local, H/128, I/128]`, one scale per 128x128 weight block, `w ~= payload * scale`
(the DeepSeek-V3 recipe of `moe_ep.quant.quantize_fp8_blockwise`; UE8M0 power-of-two values
are fine as long as they are stored as fp32).

FC1 scale grouping: which rows one 128-row scale block of `w13_scale` covers.
- canonical (`None`): rows `[128j, 128j + 128)` of the stored gate-then-up order, what
  DeepSeek-V3 checkpoints and the portable `any_fp8_fp8_bf16_torch` packs hold; the push
  kernel computes with these.
- paired (b in 8, 16, 32): rows interleaved gate/up in blocks of b before blocking, so block j
  covers gate rows `[64j, 64j + 64)` and the up rows at the same offsets (the same rows for
  every b); the pull kernel computes with these (its FC1 interleave by 8).
A canonical pack fits the pull kernel only where every gate row block has the same scales as
the up row block at the same offset (then both groupings give the same values); anything
else is refused with the first differing block named.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.fp8_layout import PULL_GATE_UP_BLOCK, Fp8BlockWeights

__all__ = [
    "check_prequantized_pack",
    "pull_weights_from_pack",
    "push_weights_from_pack",
    "quantize_pull_pack",
]

_BLOCK = 128
_SCALE_FORMATS = "fp32 block scales (amax / 448 per 128x128 block, or UE8M0 powers of two)"


def _implied_block(w: torch.Tensor, s: torch.Tensor) -> str:
    """'R x C' block size a scale plane's shape implies for payload `w`, if it divides."""
    if s.dim() != 3 or s.shape[0] != w.shape[0]:
        return "no block size"
    rows, cols = int(w.shape[1]), int(w.shape[2])
    srows, scols = int(s.shape[1]), int(s.shape[2])
    if not srows or not scols or rows % srows or cols % scols:
        return "no block size"
    return f"{rows // srows}x{cols // scols} blocks"


def check_prequantized_pack(
    kernel: str,
    weights: Any,
    *,
    pack_fc1_interleave: int | None,
    kernel_fc1_interleave: int | None,
) -> None:
    """Checks of a pre-quantized pack against a kernel's fp8 recipe (local, no collective).

    Args:
        kernel: the kernel's name, for messages.
        weights: a pre-quantized `MoEWeightPack` (`weights.prequantized`).
        pack_fc1_interleave: the FC1 scale grouping the pack was quantized with (None:
            canonical; b: paired, see the module docstring).
        kernel_fc1_interleave: the grouping the kernel computes with (pull: 8, push: None).

    Raises:
        MoeEpUsageError: naming the mismatch (the payload dtype and shapes were checked by
            `check_weight_pack`): scale format (fp32 only), block size (128x128),
            non-finite scales, or FC1 scale grouping.
    """
    e, two_i, h = (int(d) for d in weights.w13.shape)
    i = two_i // 2
    expected = {
        "w13": (e, -(-two_i // _BLOCK), h // _BLOCK),
        "w2": (e, h // _BLOCK, -(-i // _BLOCK)),
    }
    for name in ("w13", "w2"):
        w, s = getattr(weights, name), getattr(weights, f"{name}_scale")
        if s.dtype != torch.float32:
            raise MoeEpUsageError(
                f"{kernel}: {name}_scale must hold {_SCALE_FORMATS}, i.e. dtype float32; got "
                f"{s.dtype} (E8M0 / UE8M0 byte scales are another scale format: convert them "
                "to float32 powers of two)"
            )
        if tuple(s.shape) != expected[name]:
            raise MoeEpUsageError(
                f"{kernel}: {name}_scale must be float32 {list(expected[name])}, one scale per "
                f"128x128 block of {name} {tuple(w.shape)}; got {tuple(s.shape)} "
                f"({_implied_block(w, s)})"
            )
        if s.numel() and not bool(torch.isfinite(s).all()):
            raise MoeEpUsageError(f"{kernel}: {name}_scale has non-finite values (NaN or inf)")
    if kernel_fc1_interleave is None:
        if pack_fc1_interleave is not None:
            raise MoeEpUsageError(
                f"{kernel} computes FC1 with canonical 128x128 blocks over gate-then-up rows; "
                f"a pack quantized with fc1 gate/up interleave {pack_fc1_interleave} does not "
                "fit (quantize w13 without interleaving)"
            )
        return
    if pack_fc1_interleave is None:
        _check_canonical_fits_paired(kernel, weights.w13_scale, i)


def _check_canonical_fits_paired(kernel: str, s13: torch.Tensor, i: int) -> None:
    """A canonical FC1 scale plane is usable by a paired-grouping kernel iff every gate row
    block's scales equal the up row block's at the same offset."""
    gate, up = s13[:, : i // _BLOCK], s13[:, i // _BLOCK :]
    differ = gate != up
    if not bool(differ.any()):
        return
    ex, j, c = (int(v) for v in differ.nonzero()[0])
    raise MoeEpUsageError(
        f"{kernel}: w13_scale is in the canonical FC1 grouping (128-row blocks over gate-then-up "
        "rows), but the kernel quantizes FC1 over gate/up rows interleaved by "
        f"{PULL_GATE_UP_BLOCK} (one scale for gate and up rows [64j, 64j+64)); that only fits "
        "when each gate block's scale equals the up block's at the same offset, and expert "
        f"{ex}, row block {j}, column block {c} has gate scale {float(gate[ex, j, c])!r} vs up "
        f"scale {float(up[ex, j, c])!r}. Pass bf16/fp32 weights (the kernel quantizes them), "
        "or a pack quantized over interleaved rows (moe_ep_sm90.fp8_packs.quantize_pull_pack) "
        "with the config's prequantized_fc1_gate_up_interleave=8"
    )


def quantize_pull_pack(w13: torch.Tensor, w2: torch.Tensor) -> Any:
    """A pre-quantized `MoEWeightPack` in the pull kernel's grouping (use it with the config's
    `prequantized_fc1_gate_up_interleave=8`), e.g. to quantize once and store.

    Args:
        w13: `[E_local, 2I, H]` bf16/fp32, gate rows then up rows.
        w2: `[E_local, H, I]` bf16/fp32.

    Returns:
        e4m3 `w13` (gate-then-up rows) with fp32 `w13_scale [E_local, 2I/128, H/128]` taken
        over rows interleaved by 8; e4m3 `w2` with canonical 128x128 fp32 `w2_scale`.
    """
    from moe_ep.quant import deinterleave_gate_up, interleave_gate_up, quantize_fp8_blockwise
    from moe_ep.types import MoEWeightPack

    block = (_BLOCK, _BLOCK)
    q13, s13 = quantize_fp8_blockwise(interleave_gate_up(w13, PULL_GATE_UP_BLOCK), block=block)
    q2, s2 = quantize_fp8_blockwise(w2, block=block)
    return MoEWeightPack(
        w13=deinterleave_gate_up(q13, PULL_GATE_UP_BLOCK), w2=q2, w13_scale=s13, w2_scale=s2
    )


def pull_weights_from_pack(weights: Any, *, pack_fc1_interleave: int | None) -> Fp8BlockWeights:
    """A checked pre-quantized pack in the pull kernel's form (as `prepare_pull_weights`).

    The payload rows are interleaved by 8 (exact: a permutation of e4m3 bytes), then taken as
    K-major views; FC1 scales are used as given (paired pack) or regrouped from a canonical
    plane whose gate and up blocks agree (`check_prequantized_pack`). Equal bit for bit to
    `prepare_pull_weights` of the weights the pack was quantized from.
    """
    from moe_ep.quant.layout import interleave_gate_up

    s13 = weights.w13_scale
    if pack_fc1_interleave is None:
        half = int(s13.shape[1]) // 2
        # paired block j covers gate rows [64j, 64j+64): canonical gate block j // 2
        s13 = s13[:, :half].repeat_interleave(2, dim=1)
    q13 = interleave_gate_up(weights.w13, PULL_GATE_UP_BLOCK)
    return Fp8BlockWeights(
        w13=q13.permute(0, 2, 1),
        w13_scales=_aligned(s13),
        w2=_aligned(weights.w2).permute(0, 2, 1),
        w2_scales=_aligned(weights.w2_scale),
    )


def push_weights_from_pack(weights: Any) -> Fp8BlockWeights:
    """A checked canonical pre-quantized pack in the push kernel's form (contiguous
    `[E_local, N, K]` e4m3 and fp32 scales: the pack itself, as `prepare_push_weights`)."""
    return Fp8BlockWeights(
        w13=_aligned(weights.w13),
        w13_scales=_aligned(weights.w13_scale),
        w2=_aligned(weights.w2),
        w2_scales=_aligned(weights.w2_scale),
    )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with a 16-byte aligned data pointer (a copy only where needed).

    The kernels take these tensors with an assumed 16-byte alignment (TMA); a pack sliced to
    one rank's experts starts mid-allocation, e.g. `w2_scale [E, 9, 3]` fp32 (108 bytes an
    expert) from an odd expert on. The drop's own runner clones such views too."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()

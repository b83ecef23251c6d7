"""The weight-pack check of the two sm90 kernels, pre-quantized fp8 packs included (torch).

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
else is refused with the first differing block named. Each kernel turns a checked pack
into its own form in its `layout` module.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_ep.backends.support.launch_args import check_pack_geometry
from moe_ep.checks import PackShape, check_weight_pack
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm90.common.config import FP8_BLOCK

__all__ = ["check_pack", "check_prequantized_pack"]

_SCALE_FORMATS = "fp32 block scales (amax / 448 per 128x128 block, or UE8M0 powers of two)"


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
    H and I multiples of 128; a pre-quantized pack must fit the kernel's recipe
    (`check_prequantized_pack`:
    fp32 128x128 scales, FC1 scale grouping `kernel_fc1_interleave`, the pack's own grouping
    from the config's `prequantized_fc1_gate_up_interleave`, None without that field); the
    geometry must pass `config.check_problem` (top_k from the config, else 1).
    """
    shape = check_weight_pack(weights, fleet, world_size, quantized_dtypes=(torch.float8_e4m3fn,))
    for name, v in (("H", shape.hidden_size), ("I", shape.intermediate_size)):
        if v % FP8_BLOCK:
            raise MoeEpUsageError(f"{kernel}: {name} must be a multiple of {FP8_BLOCK}, got {v}")
    pack_interleave = getattr(config, "prequantized_fc1_gate_up_interleave", None)
    if not shape.prequantized and pack_interleave is not None:
        raise MoeEpUsageError(
            f"{kernel}: prequantized_fc1_gate_up_interleave={pack_interleave} describes a "
            f"pre-quantized pack, but the weights are {weights.w13.dtype} without scales "
            "(the kernel quantizes them with its own grouping): leave it None"
        )
    if shape.prequantized:
        check_prequantized_pack(
            kernel,
            weights,
            pack_fc1_interleave=pack_interleave,
            kernel_fc1_interleave=kernel_fc1_interleave,
        )
    check_pack_geometry(config, fleet, world_size, shape)
    return shape


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
        "w13": (e, -(-two_i // FP8_BLOCK), h // FP8_BLOCK),
        "w2": (e, h // FP8_BLOCK, -(-i // FP8_BLOCK)),
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
        _check_canonical_fits_paired(kernel, weights.w13_scale, i, kernel_fc1_interleave)


def _check_canonical_fits_paired(kernel: str, s13: torch.Tensor, i: int, interleave: int) -> None:
    """A canonical FC1 scale plane is usable by a paired-grouping kernel iff every gate row
    block's scales equal the up row block's at the same offset."""
    gate, up = s13[:, : i // FP8_BLOCK], s13[:, i // FP8_BLOCK :]
    differ = gate != up
    if not bool(differ.any()):
        return
    ex, j, c = (int(v) for v in differ.nonzero()[0])
    raise MoeEpUsageError(
        f"{kernel}: w13_scale is in the canonical FC1 grouping (128-row blocks over gate-then-up "
        "rows), but the kernel quantizes FC1 over gate/up rows interleaved by "
        f"{interleave} (one scale for gate and up rows [64j, 64j+64)); that only fits "
        "when each gate block's scale equals the up block's at the same offset, and expert "
        f"{ex}, row block {j}, column block {c} has gate scale {float(gate[ex, j, c])!r} vs up "
        f"scale {float(up[ex, j, c])!r}. Pass bf16/fp32 weights (the kernel quantizes them), "
        "or a pack quantized over interleaved rows (quantize_pull_pack in "
        "moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.layout) "
        "with the config's prequantized_fc1_gate_up_interleave=8"
    )

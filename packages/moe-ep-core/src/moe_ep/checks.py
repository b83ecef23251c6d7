"""Checks of user inputs, run locally before any collective.

Every failure raises `MoeEpUsageError` naming the argument, the rule and the value received.

- `check_weight_pack`: the one shape check of a weight pack (dtypes, devices, E_local,
  `[E_local, 2I, H]` / `[E_local, H, I]`, packed fp4 halves), returning the `PackShape`
  record the kernel sizes itself from. Every kernel's `validate_weights` starts here and
  adds only its own format's rules.
- `validate_forward`: one forward's tensors against the fleet and the layer's device (host
  metadata only: shapes, dtypes, devices; it reads no device value, so it runs under CUDA-graph
  capture too).
- `check_forward_values`: the value checks of those tensors (ids in range, finite top-k
  weights), which read device values on the host: eager forwards only.
- `check_live_tensor`: the metadata of `num_valid_tokens_tensor` (no device read);
  `live_token_count`: the same, then its value read on the host and range-checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = [
    "FLOAT_WEIGHT_DTYPES",
    "TOPK_WEIGHT_DTYPES",
    "PackShape",
    "check_forward_values",
    "check_live_tensor",
    "check_weight_pack",
    "live_token_count",
    "validate_forward",
]

FLOAT_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
"""Unquantized weight dtypes every kernel takes (it quantizes them with its own recipe)."""
TOPK_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""`topk_weights` dtypes a forward takes: fp32, or bf16 / fp16 (what Hugging Face routers
return), which the layer upcasts to fp32 (exact: every bf16 / fp16 value is an fp32 value)."""


@dataclass(frozen=True, kw_only=True)
class PackShape:
    """What `check_weight_pack` established about a pack (logical sizes, not storage)."""

    num_local_experts: int
    """E_local = num_experts / world_size (with a placement: its slots per rank)."""
    hidden_size: int
    """H."""
    intermediate_size: int
    """I (after SwiGLU)."""
    prequantized: bool
    """The scale planes are given: w13 / w2 hold quantized payloads."""
    packed_fp4: bool
    """The payloads are uint8 with two e2m1 values per byte (last dims halved)."""


def check_weight_pack(
    weights: MoEWeightPack,
    fleet: FleetParams,
    world_size: int,
    *,
    quantized_dtypes: tuple[torch.dtype, ...] = (),
) -> PackShape:
    """Check a weight pack against the fleet; returns its shape record.

    `quantized_dtypes` are the payload dtypes a pre-quantized pack may use for this kernel
    (empty: the kernel takes only bf16 / fp32 weights). A uint8 payload is packed fp4.
    """
    if not isinstance(weights, MoEWeightPack):
        raise MoeEpUsageError(f"weights must be a MoEWeightPack, got {type(weights).__name__}")
    e_local = fleet.experts_per_rank(world_size)
    h = fleet.hidden_size
    w13, w2 = weights.w13, weights.w2
    if weights.prequantized:
        if not quantized_dtypes:
            raise MoeEpUsageError(
                "this kernel takes bf16 / fp32 weights only, but w13_scale / w2_scale were "
                "given (pass unquantized w13 / w2 and no scales)"
            )
        allowed = quantized_dtypes
    else:
        allowed = FLOAT_WEIGHT_DTYPES
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype not in allowed:
            raise MoeEpUsageError(
                f"{name} dtype must be one of ({names}) for this kernel"
                f"{' with scales' if weights.prequantized else ''}, got {t.dtype}"
            )
    if w13.dtype != w2.dtype:
        raise MoeEpUsageError(f"w13 and w2 must share a dtype, got {w13.dtype} and {w2.dtype}")
    if w13.device != w2.device:
        raise MoeEpUsageError(f"w13 and w2 must be on one device, got {w13.device}, {w2.device}")
    packed = w13.dtype == torch.uint8
    div = 2 if packed else 1
    if int(w13.shape[0]) != e_local or int(w2.shape[0]) != e_local:
        raise MoeEpUsageError(
            "w13 / w2 must hold E_local = "
            + (
                f"num_experts / world_size = {fleet.num_experts} / {world_size}"
                if fleet.placement is None
                else "the placement's slots per rank"
            )
            + f" = {e_local} experts, got w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    i = int(w2.shape[2]) * div
    if int(w2.shape[1]) != h:
        raise MoeEpUsageError(
            f"w2 must be [E_local, H, I{'/2' if packed else ''}] with H = hidden_size = {h}, "
            f"got {tuple(w2.shape)}"
        )
    expected13 = (e_local, 2 * i, h // div)
    if packed and h % 2:
        raise MoeEpUsageError(f"packed fp4 weights need an even hidden_size, got {h}")
    if tuple(w13.shape) != expected13:
        raise MoeEpUsageError(
            f"w13 must be [E_local, 2I, H{'/2' if packed else ''}] = {expected13} "
            f"(I = {i} from w2 {tuple(w2.shape)}; gate rows first), got {tuple(w13.shape)}"
        )
    for name in ("w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale"):
        t = getattr(weights, name)
        if t is not None and t.device != w13.device:
            raise MoeEpUsageError(f"{name} must be on {w13.device} like w13, got {t.device}")
    return PackShape(
        num_local_experts=e_local,
        hidden_size=h,
        intermediate_size=i,
        prequantized=weights.prequantized,
        packed_fp4=packed,
    )


def validate_forward(
    tensors: MoEEpTensors, fleet: FleetParams, device: torch.device
) -> torch.Tensor | None:
    """Check one forward's inputs' types, shapes, dtypes and devices (host metadata only, no
    device value read); returns the caller's output buffer (or None). The value checks are
    `check_forward_values`."""
    if not isinstance(tensors, MoEEpTensors):
        raise MoeEpUsageError(f"tensors must be a MoEEpTensors, got {type(tensors).__name__}")
    x, ids, w = tensors.hidden_states, tensors.topk_ids, tensors.topk_weights
    for name, t in (("hidden_states", x), ("topk_ids", ids), ("topk_weights", w)):
        if not isinstance(t, torch.Tensor):
            raise MoeEpUsageError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != device:
            raise MoeEpUsageError(f"{name} must be on the layer's device {device}, got {t.device}")
    h = fleet.hidden_size
    if x.dim() != 2 or int(x.shape[1]) != h:
        raise MoeEpUsageError(
            f"hidden_states must be [n, H] with H = {h}, got shape {tuple(x.shape)} "
            f"(e.g. [{min(8, fleet.max_tokens_per_rank)}, {h}])"
        )
    if x.dtype != torch.bfloat16:
        raise MoeEpUsageError(f"hidden_states must be bfloat16, got {x.dtype}")
    n = int(x.shape[0])
    if n > fleet.max_tokens_per_rank:
        raise MoeEpUsageError(
            f"hidden_states has n = {n} rows, more than max_tokens_per_rank = "
            f"{fleet.max_tokens_per_rank}"
        )
    if ids.dim() != 2 or int(ids.shape[0]) != n or int(ids.shape[1]) < 1:
        raise MoeEpUsageError(
            f"topk_ids must be [n, k] with n = {n}, k >= 1, got {tuple(ids.shape)}"
        )
    if ids.dtype not in (torch.int32, torch.int64):
        raise MoeEpUsageError(f"topk_ids must be int32 or int64, got {ids.dtype}")
    if tuple(w.shape) != tuple(ids.shape):
        raise MoeEpUsageError(
            f"topk_weights must have topk_ids' shape {tuple(ids.shape)}, got {tuple(w.shape)}"
        )
    if w.dtype not in TOPK_WEIGHT_DTYPES:
        raise MoeEpUsageError(
            "topk_weights must be float32, or bfloat16 / float16 (upcast exactly to float32), "
            f"got {w.dtype}"
        )
    out = tensors.output
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise MoeEpUsageError(f"output must be a torch.Tensor or None, got {type(out)}")
        if tuple(out.shape) != (n, h) or out.dtype != torch.bfloat16 or out.device != device:
            raise MoeEpUsageError(
                f"output must be [n, H] = [{n}, {h}] bfloat16 on {device}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if not out.is_contiguous():
            raise MoeEpUsageError("output must be contiguous")
    return out


def check_forward_values(tensors: MoEEpTensors, fleet: FleetParams) -> None:
    """`topk_ids` in `[-1, E)` and finite `topk_weights`: reads device values on the host
    (two syncs), so an eager forward's check only. Call after `validate_forward`."""
    ids, w = tensors.topk_ids, tensors.topk_weights
    e = fleet.num_experts
    if ids.numel():
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()
        if lo < -1 or hi >= e:
            which, worst = ("max", hi) if hi >= e else ("min", lo)
            row = int((ids == worst).any(dim=1).nonzero()[0, 0])
            raise MoeEpUsageError(
                f"topk_ids has values outside [-1, {e}): {which}={worst} at row {row}"
            )
        if not all(map(math.isfinite, torch.stack(torch.aminmax(w)).tolist())):  # NaN: both
            row = int((~torch.isfinite(w)).any(dim=1).nonzero()[0, 0])
            raise MoeEpUsageError(
                f"topk_weights must be finite: got {w[row].tolist()} at row {row}"
            )


def check_live_tensor(tensors: MoEEpTensors, device: torch.device) -> torch.Tensor | None:
    """`tensors.num_valid_tokens_tensor` checked to be a `(1,)` int32 tensor on `device`
    (host metadata only, its value not read); None if not given."""
    live = tensors.num_valid_tokens_tensor
    if live is None:
        return None
    if not isinstance(live, torch.Tensor):
        raise MoeEpUsageError(
            f"num_valid_tokens_tensor must be a torch.Tensor or None, got {type(live).__name__}"
        )
    if tuple(live.shape) != (1,) or live.dtype != torch.int32 or live.device != device:
        raise MoeEpUsageError(
            "num_valid_tokens_tensor must be a (1,) int32 tensor on the layer's device "
            f"{device}, got {tuple(live.shape)} {live.dtype} on {live.device}"
        )
    return live


def live_token_count(tensors: MoEEpTensors, fleet: FleetParams, device: torch.device) -> int | None:
    """`tensors.num_valid_tokens_tensor` read on the host (one device-to-host copy), after
    checking it is a `(1,)` int32 tensor on `device` holding `0 <= count <= n`; None if
    not given. Call after `validate_forward`."""
    live = check_live_tensor(tensors, device)
    if live is None:
        return None
    count = int(live.item())
    n = tensors.num_tokens
    if count < 0 or count > fleet.max_tokens_per_rank:
        raise MoeEpUsageError(
            f"num_valid_tokens_tensor must hold a count in [0, max_tokens_per_rank = "
            f"{fleet.max_tokens_per_rank}], got {count}"
        )
    if count > n:
        raise MoeEpUsageError(
            f"num_valid_tokens_tensor holds {count}, more than the n = {n} rows of hidden_states"
        )
    return count

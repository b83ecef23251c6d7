"""The package's plain data: fleet shape, weight pack and per-forward tensors.

Glossary: `n` tokens on this rank, `H` hidden, `I` intermediate (after SwiGLU), `E` experts
in the fleet, `E_local = E / world_size` experts on this rank (with a `Placement`: its slots
per rank), `k` top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from moe_ep.compat.renames import either_name
from moe_ep.errors import MoeEpUsageError
from moe_ep.placement import Placement

__all__ = ["FleetParams", "MoEEpTensors", "MoEWeightPack"]


def _positive_int(name: str, value: object, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MoeEpUsageError(f"{name} must be an int >= 1, got {value!r} (e.g. {example})")


_SPLIT_FIELDS = (
    ("dtype_bytes", 2, "the hidden states are bf16 (flashinfer's split-transport size)"),
    ("algorithm", None, "a flashinfer split-transport field; moe-ep runs fused kernels only"),
    ("layout", None, "a flashinfer split-transport field; moe-ep runs fused kernels only"),
    ("tuning_live_tokens", None, "moe-ep has no offline-tuned token buckets"),
)
"""flashinfer 0.7.4 `FleetParams` fields moe-ep has no use for: each takes one value."""


@dataclass(frozen=True, init=False)
class FleetParams:
    """Shape of the whole MoE fleet, identical on every rank.

    Constructed as flashinfer-python 0.7.4's `flashinfer.moe_ep.FleetParams(num_experts,
    max_tokens_per_rank, token_hidden_size, dtype_bytes=2, algorithm, layout,
    tuning_live_tokens)`; `hidden_size=` (keyword) is moe-ep's name of `token_hidden_size`
    and reads it back. The split-transport fields are refused unless left unset.

    Experts are sharded contiguously: rank r owns experts `[r*E_local, (r+1)*E_local)`,
    unless `placement` says otherwise.
    """

    num_experts: int
    """E, the number of experts over all ranks; must be divisible by the world size."""
    max_tokens_per_rank: int
    """Upper bound on `n` for one forward on any rank (buffers may be sized from it)."""
    token_hidden_size: int
    """H (flashinfer's name; `hidden_size` reads it too)."""
    placement: Placement | None = None
    """Logical experts -> physical slots on ranks, with optional replicas (docs/placement.md);
    None, or a contiguous one (stored as None), is the contiguous sharding. Only kernels
    with `supports_placement` take another (the portable ones)."""

    dtype_bytes: int = 2
    """flashinfer's split-transport element size: only 2 (bf16 hidden states)."""
    algorithm: object = None
    """flashinfer's split-transport algorithm: only None (moe-ep has fused kernels only)."""
    layout: object = None
    """flashinfer's split-transport receive layout: only None."""
    tuning_live_tokens: int | None = None
    """flashinfer's offline-tuning bucket: only None (moe-ep has no tuned buckets)."""

    def __init__(
        self,
        num_experts: int,
        max_tokens_per_rank: int,
        token_hidden_size: int | None = None,
        dtype_bytes: int = 2,
        algorithm: object = None,
        layout: object = None,
        tuning_live_tokens: int | None = None,
        *,
        hidden_size: int | None = None,
        placement: Placement | None = None,
    ) -> None:
        hidden = either_name(
            "FleetParams", "token_hidden_size", token_hidden_size, "hidden_size", hidden_size,
            default=None,
        )  # fmt: skip
        given = {
            "num_experts": num_experts,
            "max_tokens_per_rank": max_tokens_per_rank,
            "token_hidden_size": hidden,
            "dtype_bytes": dtype_bytes,
            "algorithm": algorithm,
            "layout": layout,
            "tuning_live_tokens": tuning_live_tokens,
            "placement": placement,
        }
        for name, value in given.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    @property
    def hidden_size(self) -> int:
        """H: moe-ep's name of `token_hidden_size`."""
        return self.token_hidden_size

    def __post_init__(self) -> None:
        _positive_int("num_experts", self.num_experts, "256")
        _positive_int("max_tokens_per_rank", self.max_tokens_per_rank, "4096")
        _positive_int("token_hidden_size", self.token_hidden_size, "7168; or hidden_size=")
        for name, only, why in _SPLIT_FIELDS:
            if getattr(self, name) != only:
                raise MoeEpUsageError(
                    f"FleetParams.{name} must be {only!r}, got {getattr(self, name)!r}: {why}"
                )
        p = self.placement
        if p is None:
            return
        if not isinstance(p, Placement):
            raise MoeEpUsageError(
                f"placement must be a moe_ep.placement.Placement or None, got {type(p).__name__}"
            )
        if p.num_experts != self.num_experts:
            raise MoeEpUsageError(
                f"placement.num_experts must equal num_experts={self.num_experts}, got "
                f"{p.num_experts}"
            )
        if p.is_contiguous:  # one spelling of the default: equal fleets compare equal
            object.__setattr__(self, "placement", None)

    def experts_per_rank(self, world_size: int) -> int:
        """E_local for `world_size` (the weight pack's leading dim): the placement's slots per
        rank, else `E / world_size`; `MoeEpUsageError` unless E % world_size == 0 (or the
        placement is for another world size)."""
        _positive_int("world_size", world_size, "8")
        if self.placement is not None:
            if self.placement.world_size != world_size:
                raise MoeEpUsageError(
                    f"placement is for world_size={self.placement.world_size}, but the layer "
                    f"runs at world_size={world_size}"
                )
            return self.placement.slots_per_rank
        if self.num_experts % world_size:
            raise MoeEpUsageError(
                f"num_experts must be divisible by world_size: got num_experts="
                f"{self.num_experts}, world_size={world_size} (e.g. num_experts="
                f"{world_size * max(1, self.num_experts // world_size)})"
            )
        return self.num_experts // world_size


@dataclass(frozen=True)
class MoEWeightPack:
    """This rank's experts' weights.

    Unquantized (the kernel quantizes once at construction when its format needs it):
        w13: `[E_local, 2I, H]` bf16 or fp32; rows `[0, I)` are the gate, `[I, 2I)` the up
            projection.
        w2: `[E_local, H, I]` bf16 or fp32.
    Pre-quantized (both canonical, i.e. unswizzled, scale planes given; one alone is an
    error): w13 / w2 hold the payload (fp8, or uint8 with two e2m1 values per byte, even
    element in the low nibble, so the last dim is halved) and w13_scale / w2_scale the
    scales in the kernel's recipe (see the kernel's docs). The nvfp4 formats also take
    w13_global_scale / w2_global_scale `[E_local]` fp32, one per expert, read per format:
    `nvfp4` (the sm100 kernel and its twin) as the encode scale norm_const
    (`2688 / amax`; weight = e2m1 * scale / norm_const), `fp8_nvfp4` (the sm90 NVFP4 pull
    kernel and its twin) as the decode scale G (the checkpoint's `weight_scale_2`, about
    `amax / 2688`; weight = G * e2m1 * scale). Without them both read 1.

    Warning: a kernel may use these tensors in place (e.g. contiguous bf16 weights already
    on the layer's device are not copied): do not modify them while the layer lives.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_global_scale: torch.Tensor | None = None
    w2_global_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("w13", "w2"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor):
                raise MoeEpUsageError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
            if value.dim() != 3:
                raise MoeEpUsageError(
                    f"{name} must be 3-D [E_local, rows, cols], got shape {tuple(value.shape)}"
                )
        for name in ("w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise MoeEpUsageError(
                    f"{name} must be a torch.Tensor or None, got {type(value).__name__}"
                )
        if (self.w13_scale is None) != (self.w2_scale is None):
            given = "w13_scale" if self.w13_scale is not None else "w2_scale"
            raise MoeEpUsageError(
                f"pre-quantized weights need both scale planes: only {given} was given "
                "(pass both w13_scale and w2_scale, or neither)"
            )
        if (self.w13_global_scale is None) != (self.w2_global_scale is None):
            raise MoeEpUsageError(
                "w13_global_scale and w2_global_scale must be given together (or neither)"
            )
        if self.w13_global_scale is not None and self.w13_scale is None:
            raise MoeEpUsageError("global scales given without w13_scale / w2_scale")

    def to(self, device: torch.device | str) -> MoEWeightPack:
        """The same pack with every tensor on `device` (tensors already there are kept)."""
        return MoEWeightPack(
            *(
                None if t is None else t.to(device)
                for t in (
                    self.w13,
                    self.w2,
                    self.w13_scale,
                    self.w2_scale,
                    self.w13_global_scale,
                    self.w2_global_scale,
                )
            )  # type: ignore[arg-type]
        )

    @property
    def prequantized(self) -> bool:
        """True when the scale planes are given (w13 / w2 hold quantized payloads)."""
        return self.w13_scale is not None

    @property
    def num_local_experts(self) -> int:
        return int(self.w13.shape[0])


@dataclass(frozen=True)
class MoEEpTensors:
    """One forward's inputs on this rank.

    hidden_states: `[n, H]` bf16, contiguous rows; `n == 0` is legal.
    topk_ids: `[n, k]` int32 or int64 global expert ids in `[0, E)`; `-1` marks a padded
        slot that contributes exactly zero. A row may repeat an expert: each slot then
        contributes its own weighted term (the duplicates are summed).
    topk_weights: `[n, k]` fp32, finite; bf16 / fp16 (what Hugging Face routers return)
        are accepted and upcast exactly to fp32 by the layer; other dtypes are refused.
    output: optional `[n, H]` bf16 buffer on the same device to write into; allocated
        by the layer when None.
    num_valid_tokens_tensor: optional live-token count (keyword only; flashinfer 0.7.4's
        name for `FinalizeMode.PERSISTENT`'s count): a caller-owned `(1,)` int32 tensor on
        the layer's device, read when the forward runs: rows at or past it are neither
        dispatched nor written (the caller's `output` rows there keep their values; an
        output the layer allocates is zeros there). `0 <= count <= n`. Only kernels with
        `supports_live_tokens` (the portable ones) honour it (docs/runtime.md).

    The fields are flashinfer-python 0.7.4's `flashinfer.moe_ep.MoEEpTensors`, in its order;
    those moe-ep does not have (`UNSUPPORTED_FIELDS`: pre-quantized activations, per-call
    alphas and scales, receive counters, the split path's runtime token bound) must be None.
    """

    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    scales: torch.Tensor | None = None
    fc1_alpha: torch.Tensor | None = None
    fc2_alpha: torch.Tensor | None = None
    fc1_norm_const: torch.Tensor | None = None
    fc1_activation_per_token_scale: torch.Tensor | None = None
    recv_count: torch.Tensor | None = None
    num_tokens_per_expert: torch.Tensor | None = None
    output: torch.Tensor | None = None
    runtime_max_tokens_per_rank: int | None = None
    num_valid_tokens_tensor: torch.Tensor | None = field(default=None, kw_only=True)

    UNSUPPORTED_FIELDS: ClassVar[tuple[str, ...]] = (
        "scales",
        "fc1_alpha",
        "fc2_alpha",
        "fc1_norm_const",
        "fc1_activation_per_token_scale",
        "recv_count",
        "num_tokens_per_expert",
        "runtime_max_tokens_per_rank",
    )

    def __post_init__(self) -> None:
        for name in self.UNSUPPORTED_FIELDS:
            if getattr(self, name) is not None:
                raise MoeEpUsageError(
                    f"MoEEpTensors.{name} must be None: moe-ep takes bf16 hidden states and "
                    f"quantizes them itself, its weight scales come with the MoEWeightPack, and "
                    f"it fills no receive counters (a flashinfer.moe_ep field it cannot honour)"
                )

    @property
    def num_tokens(self) -> int:
        return int(self.hidden_states.shape[0])

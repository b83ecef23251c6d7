"""moe-ep as the experts of a Hugging Face transformers 5.x MoE model.

`shard_experts(model, bootstrap, max_tokens_per_rank=...)` replaces every experts module of
`model` (Qwen3-MoE, Mixtral, DeepSeek-V3's routed experts, ...) with a `MoeEpExperts` that
holds this rank's experts only and runs them through a `MoEEpLayer`; the model's routers,
attention and shared experts stay. transformers is an optional dependency (the
`moe-ep-core[transformers]` extra) and is never imported here: the adapter reads the
module's attributes.

Weight mapping (no transpose): transformers' `gate_up_proj` `[E, 2I, H]` (gate rows first,
`chunk(2)` order) is `MoEWeightPack.w13`, `down_proj` `[E, H, I]` is `w2`; rank r keeps
experts `[r*E/W, (r+1)*E/W)`. Experts moe-ep cannot express are refused (docs/runtime.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_ep.backends.portable.configs import PortableConfig
from moe_ep.backends.portable.experts import prepack_layout
from moe_ep.config import BootstrapConfig
from moe_ep.contract import KernelConfig
from moe_ep.device import resolve_device_detailed
from moe_ep.errors import MoeEpUsageError
from moe_ep.layer import MoEEpLayer
from moe_ep.layer.layer import resolve_backend
from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["MoeEpExperts", "ShardedExperts", "experts_modules", "shard_experts"]

# The flags transformers' `use_experts_implementation` sets, at the values moe-ep computes.
_LAYOUT_FLAGS = (
    ("has_gate", True, "experts without a gate projection (an activation of up only)"),
    ("has_bias", False, "expert biases"),
    ("is_transposed", False, "transposed weights ([E, H, 2I] / [E, I, H])"),
    ("is_concatenated", True, "interleaved gate/up rows"),
    ("has_post_expert_norm", False, "a norm after each expert"),
)


class MoeEpExperts(torch.nn.Module):
    """A transformers experts module's stand-in: `forward(hidden_states [n, H] bf16,
    top_k_index [n, k], top_k_weights [n, k]) -> [n, H] bf16` through `layer` (collective:
    every rank calls it the same number of times). `experts`: the global ids of the experts
    this rank holds."""

    def __init__(self, layer: MoEEpLayer, num_experts: int, experts: range) -> None:
        super().__init__()
        self.layer = layer
        self.num_experts = num_experts
        self.experts = experts

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return self.layer(MoEEpTensors(hidden_states, top_k_index, top_k_weights))

    def extra_repr(self) -> str:
        return f"experts {self.experts.start}..{self.experts.stop - 1} of {self.num_experts}"


@dataclass
class ShardedExperts:
    """What `shard_experts` replaced; `destroy()` (collective) releases the layers."""

    names: tuple[str, ...]
    modules: tuple[MoeEpExperts, ...]

    def destroy(self) -> None:
        """Collective and idempotent: destroy every layer, in the same order on every rank."""
        for module in self.modules:
            module.layer.destroy()

    def __enter__(self) -> ShardedExperts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def experts_modules(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of each transformers experts module of `model`, in
    `named_modules` order: the modules `use_experts_implementation` decorated (they carry
    its `has_gate` flag and a 3-D `gate_up_proj` or `up_proj`)."""
    for name, module in model.named_modules():
        weight = getattr(module, "gate_up_proj", getattr(module, "up_proj", None))
        if hasattr(module, "has_gate") and isinstance(weight, torch.Tensor) and weight.dim() == 3:
            yield name, module


def _weight(name: str, module: torch.nn.Module, attr: str) -> torch.Tensor:
    weight = getattr(module, attr, None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise MoeEpUsageError(f"{name}.{attr} must be a 3-D tensor, got {type(weight).__name__}")
    return weight


def _check_experts(name: str, module: torch.nn.Module) -> tuple[int, int]:
    """(E, H) of an experts module moe-ep computes exactly; `MoeEpUsageError` naming what it
    cannot express otherwise (gpt-oss: biases, interleaved transposed weights, its own gate
    `(up + 1) * gate * sigmoid(1.702 * gate)`)."""
    for flag, want, what in _LAYOUT_FLAGS:
        if getattr(module, flag) is not want:
            raise MoeEpUsageError(
                f"{name} ({type(module).__name__}): {flag}={getattr(module, flag)!r}; moe-ep "
                f"experts compute silu(gate) * up with [gate; up] rows and no bias, and cannot "
                f"express {what}"
            )
    own_gate = getattr(type(module), "_apply_gate", None)
    if own_gate is not None and own_gate.__module__ != "transformers.integrations.moe":
        raise MoeEpUsageError(
            f"{name} ({type(module).__name__}): its own gate function "
            f"{own_gate.__qualname__} (e.g. gpt-oss's clamped (up + 1) * gate * "
            f"sigmoid(alpha * gate)); moe-ep experts compute silu(gate) * up"
        )
    act = getattr(module, "act_fn", None)
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        raise MoeEpUsageError(
            f"{name} ({type(module).__name__}): activation {type(act).__name__}; moe-ep "
            "experts compute silu(gate) * up (hidden_act='silu')"
        )
    w13, w2 = _weight(name, module, "gate_up_proj"), _weight(name, module, "down_proj")
    e, two_i, h = (int(d) for d in w13.shape)
    if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise MoeEpUsageError(
            f"{name}: gate_up_proj {tuple(w13.shape)} and down_proj {tuple(w2.shape)} are not "
            "[E, 2I, H] and [E, H, I]"
        )
    for weight_name, weight in (("gate_up_proj", w13), ("down_proj", w2)):
        if weight.dtype != torch.bfloat16:
            raise MoeEpUsageError(
                f"{name}.{weight_name} is {weight.dtype}: the model must run in bfloat16 "
                "(moe-ep layers take bf16 hidden states), e.g. model.to(torch.bfloat16)"
            )
    return e, h


def _owned_weights_config(
    backend: str | KernelConfig, bootstrap: BootstrapConfig
) -> str | KernelConfig:
    """`backend`, but where it names the portable bf16 kernel and this rank runs on a CPU
    whose packed copy replaces the layer's weights (`experts.prepack_layout` "k16"), its
    default config with `cpu_prepacked_weights=True`: the layer holds the only reference to
    the adapter's copy of the rank's experts, so packing them costs no memory (the
    quantized kernels' default packs already where it can)."""
    if not isinstance(backend, str) or resolve_device_detailed(bootstrap).ordinal is not None:
        return backend
    kernel_cls, config = resolve_backend(backend)
    if (
        not isinstance(config, PortableConfig)
        or getattr(kernel_cls, "oracle_format", None) != "bf16"
        or prepack_layout(torch.device("cpu")) != "k16"
    ):
        return backend
    return dataclasses.replace(config, cpu_prepacked_weights=True)


def shard_experts(
    model: torch.nn.Module,
    bootstrap: BootstrapConfig,
    *,
    max_tokens_per_rank: int,
    backend: str | KernelConfig = "any_bf16_bf16_bf16_torch",
) -> ShardedExperts:
    """Collective: replace each experts module of `model` with this rank's shard of it.

    Every module is checked before the first layer joins the group (`MoeEpUsageError`
    naming the module and what moe-ep cannot express, a non-bf16 model, or experts not
    divisible by the world size). Then, module by module in `named_modules` order, this
    rank's experts are copied out, a `MoEEpLayer(bootstrap, FleetParams(E,
    max_tokens_per_rank, H), ..., backend)` is built on them and the module is swapped for
    a `MoeEpExperts`; the full expert weights are dropped with the old module. A portable
    bf16 backend named by a string packs the copy for the CPU expert GEMM's k order where
    that replaces the weights (`cpu_prepacked_weights=True`: faster decode, no memory cost,
    since the layer holds the only copy); a config object is taken as it is.

    Every rank must call it on the same architecture, then run the model the same number of
    times (each MoE layer is a collective; the tokens may differ per rank). A forward over
    more than `max_tokens_per_rank` tokens (batch x sequence) is refused.
    """
    found = list(experts_modules(model))
    if not found:
        raise MoeEpUsageError(
            f"{type(model).__name__} has no transformers experts module (one decorated with "
            "use_experts_implementation, e.g. Qwen3MoeExperts)"
        )
    chosen = _owned_weights_config(backend, bootstrap)
    plans = []
    for name, module in found:
        e, h = _check_experts(name, module)
        fleet = FleetParams(e, max_tokens_per_rank, h)
        plans.append((name, module, fleet, fleet.experts_per_rank(bootstrap.world_size)))
    built: list[MoeEpExperts] = []
    try:
        for name, module, fleet, e_local in plans:
            lo = bootstrap.rank * e_local
            weights = MoEWeightPack(
                _weight(name, module, "gate_up_proj").detach()[lo : lo + e_local].clone(),
                _weight(name, module, "down_proj").detach()[lo : lo + e_local].clone(),
            )
            replacement = MoeEpExperts(
                MoEEpLayer(bootstrap, fleet, weights, chosen),
                fleet.num_experts,
                range(lo, lo + e_local),
            )
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, replacement)
            built.append(replacement)
    except BaseException:
        ShardedExperts((), tuple(built)).destroy()
        raise
    return ShardedExperts(tuple(name for name, *_ in plans), tuple(built))

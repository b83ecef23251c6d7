"""The kernel contract: `MegaKernel`, `KernelConfig`, `RuntimeRequirements`.

A kernel class is registered under a taxonomy name (`moe_ep.registry.register_mega_kernel`)
and exposed through the `moe_ep.backends` entry-point group, whose entry name is the kernel
name. `MoEEpLayer` composes it: it validates the user's inputs, allocates the output and
calls the kernel with keyword arguments only.

Lifecycle: the classmethod `validate_weights()` checks a weight pack locally and returns
its `PackShape` (the layer calls it before its first collective); `__init__` checks the
config and the weights (unless the caller already ran `validate_weights` on them: then it
takes their record, see `validated_shape`) and prepares the weights once (no
collectives); `warmup()` and `destroy()` are collective; `stage_inputs()` copies /
quantizes the caller's tensors into the kernel's buffers and `compute_staged()` runs
dispatch -> experts -> combine into the output it was given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from moe_ep.checks import PackShape
    from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = [
    "KernelConfig",
    "KernelRuntime",
    "MegaKernel",
    "RuntimeRequirements",
    "caller_validated_weights",
    "validated_shape",
]

# (weights, fleet, world_size, config, shape) a caller validated for the construction
# under way.
_VALIDATED: ContextVar[tuple[Any, Any, int, Any, PackShape] | None] = ContextVar(
    "moe_ep_validated_weights", default=None
)


@contextmanager
def caller_validated_weights(
    weights: MoEWeightPack,
    fleet: FleetParams,
    world_size: int,
    config: KernelConfig,
    shape: PackShape,
) -> Iterator[None]:
    """Within the block, kernels built from exactly these objects take `shape` instead of
    running their own weight checks: the caller ran the kernel class's `validate_weights`
    on them for this one construction (`MoEEpLayer` does, before its first collective),
    so the full pass over the weights (shapes, finiteness) runs once."""
    token = _VALIDATED.set((weights, fleet, world_size, config, shape))
    try:
        yield
    finally:
        _VALIDATED.reset(token)


def validated_shape(
    weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: KernelConfig
) -> PackShape | None:
    """The caller's record inside `caller_validated_weights` for these very objects
    (identity, not equality: another pack with equal shapes was not checked), else None."""
    done = _VALIDATED.get()
    if (
        done is not None
        and done[0] is weights
        and done[1] is fleet
        and done[2] == world_size
        and done[3] is config
    ):
        return done[4]
    return None


@dataclass(frozen=True, kw_only=True)
class RuntimeRequirements:
    """What a kernel needs from the bootstrap beyond torch.distributed."""

    cuda: bool = False
    """Needs a CUDA device (an NCCL group)."""
    nvshmem: bool = False
    """Needs NVSHMEM initialised over the EP group."""


class KernelRuntime(Protocol):
    """What a kernel uses of its runtime handle (`moe_ep.runtime.Runtime` is one), so the
    contract names no module above it."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def group(self) -> Any: ...

    @property
    def device(self) -> torch.device: ...

    def barrier(self) -> None: ...

    def gather_json(self, payload: Any, *, what: str) -> list[Any]: ...


@dataclass(frozen=True, kw_only=True)
class KernelConfig:
    """Base of kernel config dataclasses; subclasses set `kernel_name` to their taxonomy name."""

    kernel_name: ClassVar[str] = ""


class MegaKernel(ABC):
    """One kernel implementation behind the taxonomy name it is registered under.

    Subclasses set `config_cls` (a `KernelConfig` subclass; `config_cls()` must be a valid
    default) and `requirements`; `register_mega_kernel` sets `kernel_name` and
    `deprecated_aliases`.
    """

    kernel_name: ClassVar[str] = ""
    deprecated_aliases: ClassVar[tuple[str, ...]] = ()
    config_cls: ClassVar[type[KernelConfig]] = KernelConfig
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements()
    supports_placement: ClassVar[bool] = False
    """Honours `FleetParams.placement` other than contiguous (the layer refuses it for a
    kernel without this, before any collective)."""
    supports_unfinalized: ClassVar[bool] = False
    """Implements `compute_unfinalized` (`MoEEpLayer.forward_unfinalized`; the layer refuses
    it for a kernel without this, before any collective)."""
    supports_live_tokens: ClassVar[bool] = False
    """Honours `MoEEpTensors.num_valid_tokens_tensor` (the layer then hands it only the live
    rows; refused for a kernel without this, before any collective)."""
    capturable: bool = False
    """A warmed forward makes no host synchronisation, so it can be captured in a CUDA
    graph (the layer refuses a forward under capture for a kernel without this). Per
    instance: a kernel sets it in `__init__` for the configs it holds for (the portable
    bf16 kernel with `capture_safe=True`)."""

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(True, "") if this kernel can run on this machine, else (False, reason)."""
        return True, ""

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: KernelConfig
    ) -> PackShape:
        """Local checks of a weight pack for this kernel and config (no collective);
        `MoeEpUsageError` naming the tensor and the rule; returns the pack's record.
        Default: the generic pack checks (`moe_ep.checks.check_weight_pack`: bf16 / fp32,
        shapes); a kernel adds its format's rules to those."""
        from moe_ep.checks import check_weight_pack  # torch: not on `import moe_ep.contract`

        return check_weight_pack(weights, fleet, world_size)

    def __init__(
        self,
        *,
        config: KernelConfig,
        fleet: FleetParams,
        runtime: KernelRuntime,
        weights: MoEWeightPack,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.runtime = runtime

    @abstractmethod
    def stage_inputs(self, *, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Stage this rank's inputs; returns an opaque handle for `compute_staged`."""

    @abstractmethod
    def compute_staged(self, *, staged: Any) -> torch.Tensor:
        """Dispatch, run the experts and combine into the staged output; returns it."""

    def compute_unfinalized(
        self, *, staged: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch and run the experts without the top-k reduce: `(rows [n*k, H] bf16,
        weights [n, k] fp32, route_map [n, k] int32)` (`MoEEpLayer.forward_unfinalized`).
        Only for kernels with `supports_unfinalized`."""
        raise NotImplementedError(f"{self.kernel_name} has no unfinalized forward")

    @property
    def rebuilds_weights(self) -> bool:
        """Whether this kernel keeps no reference to the tensors of the pack it was built
        from and can give that pack back bit for bit (`rebuilt_weights`). Where it can,
        `MoEEpLayer` drops its own reference to the caller's pack (the caller's tensors are
        freed once the caller drops them) and asks for it again when it needs it
        (`apply_placement`, `evict`). Default False: the layer keeps the pack."""
        return False

    def rebuilt_weights(self) -> MoEWeightPack:
        """The pack this kernel was built from, as a new copy (see `rebuilds_weights`)."""
        raise NotImplementedError(f"{type(self).__name__} does not rebuild its weight pack")

    def warmup(self) -> None:  # noqa: B027 - optional hook, collective when overridden
        """Collective: compile / allocate / touch everything a first forward would."""

    def destroy(self) -> None:  # noqa: B027 - optional hook, collective when overridden
        """Collective: release workspaces. Must be idempotent."""

"""The contract every registered kernel implements.

A kernel class is registered under a taxonomy name (`moe_ep.registry.register_mega_kernel`)
and exposed through the `moe_ep.backends` entry-point group, whose entry name is the kernel
name. `MoEEpLayer` composes it: it validates the user's inputs, allocates the output and
calls the kernel with keyword arguments only.

Lifecycle: `__init__` validates the config against the fleet and prepares the weights once
(no collectives); `warmup()` and `destroy()` are collective; `stage_inputs()` copies/quantizes
the caller's tensors into the kernel's buffers and `compute_staged()` runs dispatch -> experts
-> combine into the output it was given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from moe_ep.layer.params import FleetParams, MoEEpTensors, MoEWeightPack
    from moe_ep.runtime import Runtime

__all__ = ["KernelConfig", "MegaKernel", "RuntimeRequirements"]


@dataclass(frozen=True, kw_only=True)
class RuntimeRequirements:
    """What a kernel needs from the bootstrap beyond torch.distributed."""

    cuda: bool = False
    """Needs a CUDA device (an NCCL group)."""
    nvshmem: bool = False
    """Needs NVSHMEM initialised over the EP group."""


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

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(True, "") if this kernel can run on this machine, else (False, reason)."""
        return True, ""

    def __init__(
        self,
        *,
        config: KernelConfig,
        fleet: FleetParams,
        runtime: Runtime,
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

    def warmup(self) -> None:  # noqa: B027 - optional hook, collective when overridden
        """Collective: compile / allocate / touch everything a first forward would."""

    def destroy(self) -> None:  # noqa: B027 - optional hook, collective when overridden
        """Collective: release workspaces. Must be idempotent."""

"""Base of the sm100 kernels whose launch path is not written yet.

They register (so `moe-ep kernels` lists them with a precise reason), validate their configs
and report availability; constructing one raises `MoeEpUnavailableError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moe_ep.backends.base import MegaKernel
from moe_ep.errors import MoeEpUnavailableError

if TYPE_CHECKING:
    import torch

    from moe_ep.layer.params import FleetParams, MoEEpTensors, MoEWeightPack
    from moe_ep.runtime import Runtime

__all__ = ["LAUNCH_NOT_WRITTEN", "UnlaunchedKernel"]

LAUNCH_NOT_WRITTEN = "moe_ep_sm100 has no launch path for this kernel yet"


class UnlaunchedKernel(MegaKernel):
    """A registered kernel that cannot be constructed yet; `availability()` says why."""

    def __init__(
        self,
        *,
        config: Any,
        fleet: FleetParams,
        runtime: Runtime,
        weights: MoEWeightPack,
    ) -> None:
        _, why = self.availability()
        raise MoeEpUnavailableError(f"{self.kernel_name} cannot run here: {why}")

    def stage_inputs(self, *, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        raise MoeEpUnavailableError(LAUNCH_NOT_WRITTEN)

    def compute_staged(self, *, staged: Any) -> torch.Tensor:
        raise MoeEpUnavailableError(LAUNCH_NOT_WRITTEN)

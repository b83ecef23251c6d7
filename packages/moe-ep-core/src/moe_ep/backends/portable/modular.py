"""`ModularKernel`: one `PrepareFinalize` paired with one `Experts` (the portable seam)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_ep.backends.portable.experts_protocol import Experts
from moe_ep.backends.portable.prepare_finalize import PrepareFinalize
from moe_ep.backends.portable.recipes import PreparedWeights
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import MoEEpTensors

__all__ = ["ModularKernel"]


@dataclass
class _Staged:
    handle: Any
    """The prepare/finalize part's staged handle."""


def _check_part(name: str, part: object, methods: tuple[str, ...], protocol: str) -> None:
    missing = [m for m in methods if not callable(getattr(part, m, None))]
    if missing:
        raise MoeEpUsageError(
            f"{name} must implement {protocol} ({', '.join(methods)}); "
            f"{type(part).__name__} lacks {', '.join(missing)}"
        )


class ModularKernel:
    """Stage -> prepare (dispatch) -> experts -> finalize (combine), any pair of parts.

    The portable kernels are compositions of `AllToAllPrepareFinalize` and `TorchExperts`;
    either part can be replaced by another implementation of its protocol.
    """

    def __init__(self, prepare_finalize: PrepareFinalize, experts: Experts) -> None:
        _check_part(
            "prepare_finalize",
            prepare_finalize,
            ("stage", "prepare", "finalize", "clear"),
            "PrepareFinalize",
        )
        _check_part("experts", experts, ("apply", "clear"), "Experts")
        self.prepare_finalize = prepare_finalize
        self.experts = experts

    def stage(self, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Local: plan and quantize this rank's tokens; a handle for one `compute`."""
        return _Staged(self.prepare_finalize.stage(tensors, output))

    def compute(self, staged: Any, weights: PreparedWeights) -> torch.Tensor:
        """Collective: dispatch, the experts on `weights`, combine; returns the output."""
        expert_out, state = self._experts_out(staged, weights)
        return self.prepare_finalize.finalize(expert_out, state)

    def compute_unfinalized(
        self, staged: Any, weights: PreparedWeights
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Collective: `compute` with the finalize that does not reduce
        (`PrepareFinalize.finalize_unreduced`): rows, weights, route map."""
        _check_part(
            "prepare_finalize",
            self.prepare_finalize,
            ("finalize_unreduced",),
            "an unfinalized forward",
        )
        expert_out, state = self._experts_out(staged, weights)
        return self.prepare_finalize.finalize_unreduced(expert_out, state)

    def _experts_out(self, staged: Any, weights: PreparedWeights) -> tuple[torch.Tensor, Any]:
        """Dispatch and the experts: one output row per dispatched pair, and the state."""
        if not isinstance(staged, _Staged):
            raise MoeEpUsageError(
                f"staged must come from ModularKernel.stage, got {type(staged).__name__}"
            )
        dispatched, state = self.prepare_finalize.prepare(staged.handle)
        expert_out = self.experts.apply(dispatched, weights)
        del dispatched  # the received rows are no longer needed
        return expert_out, state

    def forward(
        self, tensors: MoEEpTensors, output: torch.Tensor, weights: PreparedWeights
    ) -> torch.Tensor:
        """Collective: `compute(stage(tensors, output), weights)`."""
        return self.compute(self.stage(tensors, output), weights)

    def clear(self) -> None:
        """Drop both parts' buffers (idempotent, local)."""
        self.prepare_finalize.clear()
        self.experts.clear()

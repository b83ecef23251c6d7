"""The experts part of the portable seam (`prepare_finalize` holds the other part)."""

from __future__ import annotations

from typing import Protocol

import torch

from moe_ep.backends.portable.prepare_finalize import Dispatched
from moe_ep.backends.portable.recipes import PreparedWeights

__all__ = ["Experts"]


class Experts(Protocol):
    """FC1 -> SwiGLU -> FC2 of the pairs a `PrepareFinalize` dispatched to this rank.

    Sees only the `Dispatched` record and the prepared weights (never the dispatch's own
    state); local, no collective.
    """

    def apply(self, dispatched: Dispatched, weights: PreparedWeights) -> torch.Tensor:
        """`[P, H]` bf16: pair p's expert output at row p (`Dispatched` pair order); valid
        until the next `apply`."""
        ...

    def clear(self) -> None:
        """Drop the buffers kept across forwards (idempotent, local)."""
        ...

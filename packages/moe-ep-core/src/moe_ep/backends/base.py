"""Transitional: removed in the portable-seam step (the contract lives in `moe_ep.contract`)."""

from moe_ep.contract import (
    KernelConfig,
    MegaKernel,
    RuntimeRequirements,
    caller_validated_weights,
    weights_validated_by_caller,
)

__all__ = [
    "KernelConfig",
    "MegaKernel",
    "RuntimeRequirements",
    "caller_validated_weights",
    "weights_validated_by_caller",
]

"""Transitional: removed in the portable-seam step (the checks live in `moe_ep.checks`)."""

from __future__ import annotations

import torch

from moe_ep.checks import TOPK_WEIGHT_DTYPES, check_weight_pack, validate_forward
from moe_ep.types import FleetParams, MoEWeightPack

__all__ = ["TOPK_WEIGHT_DTYPES", "validate_forward", "validate_weight_pack"]


def validate_weight_pack(
    weights: MoEWeightPack,
    fleet: FleetParams,
    world_size: int,
    *,
    quantized_dtypes: tuple[torch.dtype, ...] = (),
) -> tuple[int, int]:
    """(E_local, I) of `check_weight_pack`, for the portable kernel until it takes the
    record."""
    shape = check_weight_pack(weights, fleet, world_size, quantized_dtypes=quantized_dtypes)
    return shape.num_local_experts, shape.intermediate_size

"""What the sm100 kernels (CuTe DSL nvfp4 / mxfp8, DeepGEMM) share: the pack check."""

from __future__ import annotations

from typing import Any

import torch

from moe_ep.backends.support.launch_args import check_pack_geometry
from moe_ep.checks import PackShape, check_weight_pack
from moe_ep.types import FleetParams, MoEWeightPack

__all__ = ["check_sm100_pack"]


def check_sm100_pack(
    weights: MoEWeightPack,
    fleet: FleetParams,
    world_size: int,
    config: Any,
    *,
    payload_dtype: torch.dtype,
) -> PackShape:
    """Local checks of a `MoEWeightPack` before any collective: the generic pack checks
    (`check_weight_pack`; a pre-quantized payload must be `payload_dtype`, uint8 being
    packed fp4) and the geometry against `config.check_problem` (top_k from the config,
    else 1)."""
    shape = check_weight_pack(weights, fleet, world_size, quantized_dtypes=(payload_dtype,))
    check_pack_geometry(config, fleet, world_size, shape)
    return shape

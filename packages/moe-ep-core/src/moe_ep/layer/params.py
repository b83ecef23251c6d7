"""Transitional: removed in the portable-seam step (the data types live in `moe_ep.types`)."""

from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["FleetParams", "MoEEpTensors", "MoEWeightPack"]

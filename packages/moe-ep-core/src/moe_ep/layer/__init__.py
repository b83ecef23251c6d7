"""The user-facing layer: `MoEEpLayer` and its plain data (`FleetParams`, `MoEWeightPack`,
`MoEEpTensors`)."""

from moe_ep.layer.layer import MoEEpLayer
from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["FleetParams", "MoEEpLayer", "MoEEpTensors", "MoEWeightPack"]

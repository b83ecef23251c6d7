"""moe-ep: a Mixture-of-Experts expert-parallel runtime for LLM inference.

Public names are resolved lazily so that `import moe_ep` stays light (no torch.distributed
set-up, no backend import) and works on machines without a GPU. The exception classes
(`moe_ep.MoeEpUsageError`, ...) come from `moe_ep.errors`, which imports no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_ep.config import BootstrapConfig
    from moe_ep.device import resolve_local_device
    from moe_ep.errors import (
        MoeEpError,
        MoeEpPeerError,
        MoeEpTimeoutError,
        MoeEpUnavailableError,
        MoeEpUsageError,
    )
    from moe_ep.layer import FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack

__all__ = [
    "BootstrapConfig",
    "FleetParams",
    "MoEEpLayer",
    "MoEEpTensors",
    "MoEWeightPack",
    "MoeEpError",
    "MoeEpPeerError",
    "MoeEpTimeoutError",
    "MoeEpUnavailableError",
    "MoeEpUsageError",
    "__version__",
    "resolve_local_device",
]

__version__ = "0.1.0"

_LAZY = {
    "BootstrapConfig": "moe_ep.config",
    "resolve_local_device": "moe_ep.device",
    "FleetParams": "moe_ep.layer",
    "MoEEpLayer": "moe_ep.layer",
    "MoEEpTensors": "moe_ep.layer",
    "MoEWeightPack": "moe_ep.layer",
    "MoeEpError": "moe_ep.errors",
    "MoeEpPeerError": "moe_ep.errors",
    "MoeEpTimeoutError": "moe_ep.errors",
    "MoeEpUnavailableError": "moe_ep.errors",
    "MoeEpUsageError": "moe_ep.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'moe_ep' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

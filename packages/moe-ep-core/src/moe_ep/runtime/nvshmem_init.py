"""NVSHMEM over the EP group (nvshmem4py), only for kernels whose requirements ask for it.

Warning: this path has never run on a GPU in this project's CI (no GPU there); it is written
against nvshmem4py 0.4 (`nvshmem.core.get_unique_id`, `init(initializer_method="uid")`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from moe_ep.device import DeviceResolution

__all__ = ["finalize_nvshmem", "init_nvshmem", "nvshmem_unavailable_reason"]


def nvshmem_unavailable_reason(device: DeviceResolution) -> str | None:
    """None if NVSHMEM can be initialised here, else why not (checked before collectives)."""
    if device.ordinal is None:
        return "no CUDA device is visible (NVSHMEM needs a GPU)"
    try:
        import nvshmem.core  # noqa: F401
    except Exception as exc:
        return (
            f"nvshmem4py could not be imported ({type(exc).__name__}: {exc}); install the "
            "moe-ep sm90/sm100 extra"
        )
    return None


def init_nvshmem(
    *,
    group: Any,
    rank: int,
    world_size: int,
    device: torch.device,
    broadcast: Callable[[bytes], bytes],
) -> None:
    """Collective over `group`: a unique id made on group rank 0 is sent to every rank by
    `broadcast` (the runtime's bounded broadcast of bytes), then every rank calls
    `nvshmem.core.init` with it on `device` (the ordinal from `resolve_local_device`).

    Warning: never run on a GPU in this project's CI. NVSHMEM's own bootstrap inside
    `init` is not bounded by moe-ep's timeout.
    """
    import nvshmem.core as nvshmem

    try:
        from cuda.core import Device
    except ImportError:  # older cuda-core
        from cuda.core.experimental import Device

    dev = Device(device.index)
    dev.set_current()
    # the id travels pickled, as broadcast_object_list would send it, only from rank 0
    mine = pickle.dumps(nvshmem.get_unique_id(empty=False)) if rank == 0 else b""
    uid = pickle.loads(broadcast(mine))  # bytes from group rank 0 only
    nvshmem.init(device=dev, uid=uid, rank=rank, nranks=world_size, initializer_method="uid")


def finalize_nvshmem() -> None:
    """Local: `nvshmem.core.finalize()` (callers barrier first)."""
    import nvshmem.core as nvshmem

    nvshmem.finalize()

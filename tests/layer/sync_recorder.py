"""`recording()`: every aten op a block runs, and apart those that read a device value on
the host (the syncs a CUDA-graph capture cannot hold). Shared by the capture tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",  # .item(), bool(t), int(t)
        "nonzero",
        "masked_select",
        "unique_dim",
        "unique_consecutive",
        "unique_dim_consecutive",
        "_unique",
        "_unique2",
        "bincount",  # its CUDA kernel reads the max on the host
    }
)


class HostSyncRecorder(TorchDispatchMode):
    """Records every aten op, and in `synced` those that read a device value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.synced: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        self.ops.append(str(func))
        no_size = name == "repeat_interleave" and kwargs.get("output_size") is None
        if name in SYNC_OPS or no_size:
            self.synced.append(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording() -> Iterator[HostSyncRecorder]:
    """The recorder, with tensor -> list / numpy (no aten op) recorded as syncs too."""
    rec = HostSyncRecorder()
    real_tolist, real_numpy = torch.Tensor.tolist, torch.Tensor.numpy

    def tolist(t: torch.Tensor) -> Any:
        rec.synced.append("Tensor.tolist")
        return real_tolist(t)

    def numpy(t: torch.Tensor, *a: Any, **kw: Any) -> Any:
        rec.synced.append("Tensor.numpy")
        return real_numpy(t, *a, **kw)

    torch.Tensor.tolist, torch.Tensor.numpy = tolist, numpy  # type: ignore[method-assign]
    try:
        with rec:
            yield rec
    finally:
        torch.Tensor.tolist, torch.Tensor.numpy = real_tolist, real_numpy  # type: ignore[method-assign]

"""Recording stand-ins for what a CuTe DSL launch path imports on a GPU machine (any of the
drops' kernels: sm90 pull, sm100 nvfp4 / mxfp8).

`install_fake_modules(monkeypatch, ...)` puts fake `cutlass` (+ `.cute`, `.cute.typing`,
`.torch`), `cuda.bindings.driver` and `nvshmem.core` (+ `.interop.torch`) modules into
`sys.modules`, makes `torch.cuda.synchronize` a no-op and `torch.cuda.current_stream`
report `FakeGpu.stream`. `recording_kernel_class` is a drop-kernel stand-in. Every call the
real `_compile` / `_launch` make is recorded in the `FakeGpu` (`sm100_fakes` defines it);
nothing here knows the expected values: the tests state them.
"""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from sm100_fakes import FakeGpu, FakeStream

__all__ = ["FakeGpu", "FakeStream", "install_fake_modules", "recording_kernel_class"]


def _module(name: str, **attrs: Any) -> ModuleType:
    m = ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def install_fake_modules(monkeypatch: pytest.MonkeyPatch, *, world_size: int, rank: int) -> FakeGpu:
    """Install the fake modules (module docstring); returns the recorder."""
    gpu = FakeGpu(world_size=world_size, rank=rank)
    dtypes = {n: f"cutlass.{n}" for n in ("BFloat16", "Float8E4M3FN", "Uint8")}
    typing = _module("cutlass.cute.typing", AddressSpace=SimpleNamespace(gmem="gmem"))
    runtime = SimpleNamespace(
        make_ptr=gpu.make_ptr,
        make_fake_tensor=gpu.make_fake_tensor,
        make_fake_compact_tensor=gpu.make_fake_compact_tensor,
    )
    cute = _module(
        "cutlass.cute",
        compile=gpu.compile,
        runtime=runtime,
        typing=typing,
        sym_int32=lambda: "sym_int32",
        sym_int64=lambda: "sym_int64",
    )
    ctorch = _module("cutlass.torch", from_dlpack=gpu.from_dlpack)
    cutlass = _module("cutlass", cute=cute, torch=ctorch, **dtypes)
    driver = _module("cuda.bindings.driver", CUstream=FakeStream)
    bindings = _module("cuda.bindings", driver=driver)
    interop_torch = _module("nvshmem.core.interop.torch", tensor_get_buffer=gpu.tensor_get_buffer)
    core = _module(
        "nvshmem.core",
        tensor=gpu.sym_tensor,
        free_tensor=gpu.freed.append,
        get_peer_buffer=gpu.get_peer_buffer,
        get_peer_tensor=gpu.get_peer_tensor,
        tensor_get_buffer=gpu.tensor_get_buffer,
        my_pe=lambda: gpu.rank,
        interop=_module("nvshmem.core.interop", torch=interop_torch),
    )
    modules = {
        "cutlass": cutlass,
        "cutlass.cute": cute,
        "cutlass.cute.typing": typing,
        "cutlass.torch": ctorch,
        "cuda": _module("cuda", bindings=bindings),
        "cuda.bindings": bindings,
        "cuda.bindings.driver": driver,
        "nvshmem": _module("nvshmem", core=core),
        "nvshmem.core": core,
        "nvshmem.core.interop": core.interop,
        "nvshmem.core.interop.torch": interop_torch,
    }
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(
        torch.cuda, "current_stream", lambda *a, **k: SimpleNamespace(cuda_stream=gpu.stream)
    )
    return gpu


def recording_kernel_class(gpu: FakeGpu, combine_region: str, kind: str = "") -> type:
    """A drop-kernel stand-in: records its constructor keywords, answers workspace sizes and
    lays out the bf16 combine cells `[T, k, H]` (region `combine_region`) after 256 counter
    bytes, as the drops' kernels do (their real region tables are read by the compile-only
    checks)."""

    class FakeKernel:
        def __init__(self, **kwargs: Any) -> None:
            self.kind, self.kwargs = kind, kwargs
            gpu.kernels.append(self)
            t, k, h = kwargs["max_tokens_per_rank"], kwargs["num_topk"], kwargs["hidden"]
            spec = SimpleNamespace(shape=(t, k, h), cute_dtype=SimpleNamespace(width=16))
            self._shared_offsets = {combine_region: 256}
            self._shared_region_by_name = {combine_region: spec}
            self.sizes = (1024, 256 + 2 * t * k * h + 64)

        def get_workspace_sizes(self) -> tuple[int, int]:
            return self.sizes

    return FakeKernel

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
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

__all__ = [
    "FakeCompiled",
    "FakeCuteTensor",
    "FakeGpu",
    "FakePtr",
    "FakeStream",
    "FakeSymBufferHost",
    "assert_heap_bound",
    "install_fake_modules",
    "recording_kernel_class",
]


@dataclass
class FakeCuteTensor:
    """What `cutlass.torch.from_dlpack` returned: the torch tensor, its assumed alignment
    and, once `mark_layout_dynamic` ran, the leading dim it was told."""

    tensor: torch.Tensor
    assumed_align: int
    leading_dim: int | None = None

    def mark_layout_dynamic(self, leading_dim: int) -> FakeCuteTensor:
        return FakeCuteTensor(self.tensor, self.assumed_align, leading_dim)


@dataclass(frozen=True)
class FakePtr:
    dtype: Any
    address: int
    memspace: Any
    assumed_align: int


@dataclass(frozen=True)
class FakeStream:
    handle: int


@dataclass
class FakeCompiled:
    """The compiled kernel: records each launch's keyword arguments and, through `on_launch`,
    lets a test look at buffers at launch time."""

    launches: list[dict[str, Any]] = field(default_factory=list)
    on_launch: Any = None

    def __call__(self, **kwargs: Any) -> None:
        self.launches.append(kwargs)
        if self.on_launch is not None:
            self.on_launch(kwargs)


@dataclass
class FakeGpu:
    """Everything the fakes recorded, plus knobs: `stream` (the handle `torch.cuda`'s
    current stream reports), `stale_peer_extra` (bytes by which a peer buffer looks larger
    than the tensor, as nvshmem4py's tracker can after an address is reused)."""

    world_size: int
    rank: int
    stream: int = 7
    stale_peer_extra: int = 0
    symmetric: list[torch.Tensor] = field(default_factory=list)
    peers: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    freed: list[torch.Tensor] = field(default_factory=list)
    dlpack: list[FakeCuteTensor] = field(default_factory=list)
    pointers: list[FakePtr] = field(default_factory=list)
    compiles: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)
    kernels: list[Any] = field(default_factory=list)
    compiled: FakeCompiled = field(default_factory=FakeCompiled)
    fake_tensors: list[tuple[Any, ...]] = field(default_factory=list)

    # -- nvshmem.core ---------------------------------------------------------------------
    def sym_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype != torch.uint8:  # what older nvshmem4py releases support, and all we use
            raise TypeError(f"fake nvshmem.core.tensor: dtype {dtype} not supported")
        t = torch.full(shape, 0xAB, dtype=dtype)  # NVSHMEM memory is not zeroed
        self.symmetric.append(t)
        self.peers[id(t)] = [
            t if p == self.rank else torch.empty(t.numel() + self.stale_peer_extra, dtype=dtype)
            for p in range(self.world_size)
        ]
        return t

    def tensor_get_buffer(self, t: torch.Tensor) -> tuple[Any, int, torch.dtype]:
        return SimpleNamespace(owner=t), t.numel() * t.element_size(), t.dtype

    def get_peer_buffer(self, buf: Any, peer: int) -> torch.Tensor:
        return self.peers[id(buf.owner)][peer]  # a tensor: torch's from_dlpack accepts it

    def get_peer_tensor(self, t: torch.Tensor, peer: int) -> torch.Tensor:
        # nvshmem4py 0.4.1's definition, verbatim in effect
        buf, _, _ = self.tensor_get_buffer(t)
        return (
            torch.utils.dlpack.from_dlpack(self.get_peer_buffer(buf, peer))
            .view(t.dtype)
            .view(t.shape)
        )

    # -- cutlass ----------------------------------------------------------------------------
    def from_dlpack(self, t: torch.Tensor, assumed_align: int = 16) -> FakeCuteTensor:
        ct = FakeCuteTensor(t, assumed_align)
        self.dlpack.append(ct)
        return ct

    def make_ptr(self, dtype: Any, address: int, memspace: Any, assumed_align: int) -> FakePtr:
        p = FakePtr(dtype, address, memspace, assumed_align)
        self.pointers.append(p)
        return p

    def make_fake_tensor(
        self, dtype: Any, shape: tuple, *, stride: tuple, memspace: Any, assumed_align: int
    ) -> tuple:
        t = ("strided", dtype, tuple(shape), tuple(stride), assumed_align)
        self.fake_tensors.append(t)
        return t

    def make_fake_compact_tensor(
        self, dtype: Any, shape: tuple, *, memspace: Any, assumed_align: int
    ) -> tuple:
        t = ("compact", dtype, tuple(shape), None, assumed_align)
        self.fake_tensors.append(t)
        return t

    def compile(self, kernel: Any, **args: Any) -> FakeCompiled:
        self.compiles.append((kernel, args))
        return self.compiled


class FakeSymBufferHost:
    """The drop's `SymBufferHost`, recording its keyword arguments."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


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
            self.pool_token_capacity = 384  # the sm100 mxfp8 kernel's dispatch pool rows

        def get_workspace_sizes(self) -> tuple[int, int]:
            return self.sizes

    return FakeKernel


def assert_heap_bound(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, need: int, warmup: Any
) -> None:
    """With an NVSHMEM heap one byte short of `need`, `warmup()` is refused (naming the
    bytes and a size to set) before anything symmetric is allocated; with exactly `need` it
    allocates `need` symmetric bytes."""
    from moe_ep.errors import MoeEpUsageError

    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", str(need - 1))
    with pytest.raises(MoeEpUsageError, match=rf"need {need} bytes .*NVSHMEM_SYMMETRIC_SIZE=1m"):
        warmup()
    assert gpu.symmetric == []
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", str(need))
    warmup()
    assert sum(t.numel() for t in gpu.symmetric) == need


def install_fake_pull_kernel(
    monkeypatch: pytest.MonkeyPatch, *, world_size: int, rank: int
) -> FakeGpu:
    """`install_fake_modules`, with the sm90 fp8 pull kernel's drop API replaced by a
    recording kernel class and the kernel reported available (its launch-path tests)."""
    import moe_ep_sm90.common.pull_drop as pull_drop
    import moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.kernel as pull
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.upstream import PullKernelApi

    gpu = install_fake_modules(monkeypatch, world_size=world_size, rank=rank)
    kernel_cls = recording_kernel_class(gpu, pull_drop.COMBINE_REGION)
    api = PullKernelApi(
        native_kernel=kernel_cls,
        swap_ab_kernel=kernel_cls,
        sym_buffer_host=FakeSymBufferHost,
        sf_padding_block=128,
        e8m0_sf_vec_size=32,
    )
    monkeypatch.setattr(pull, "load_pull_api", lambda: api)
    cls = pull.Sm90Fp8Fp8Bf16PullCutedslKernel
    monkeypatch.setattr(cls, "availability", classmethod(lambda c: (True, "")))
    return gpu

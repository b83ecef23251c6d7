"""`BootstrapConfig.stream`: the layer works on that CUDA stream.

There is no GPU here: `torch.cuda.ExternalStream` and `torch.cuda.stream` are replaced by
recording fakes and the layer's rank is made to look like a CUDA rank (the runtime itself
stays on CPU), which shows that the kernel's construction, the input checks, staging,
compute, warmup and destroy all run inside the stream's context. That the GPU kernels then
launch on it rests on torch: inside `torch.cuda.stream(s)`, `torch.cuda.current_stream()`
is `s`, which the CuTe DSL launches
(`moe_ep.backends.support.cutedsl.launch_glue.current_stream`), the push drop's TVM-FFI
calls and torch ops use. Never run on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import moe_ep.layer.layer as layer_module
from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable import Bf16TorchKernel
from moe_ep.spawn import free_port

E, H, I = 4, 128, 128  # noqa: E741 - the glossary names
HANDLE = 0x7F00_1234  # a cudaStream_t as an int


class FakeExternalStream:
    def __init__(self, stream_ptr: int, device: Any = None) -> None:
        self.cuda_stream = stream_ptr
        self.device = device


def _pack() -> MoEWeightPack:
    g = torch.Generator().manual_seed(0)
    return MoEWeightPack(
        (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16(),
        (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16(),
    )


def _inputs() -> MoEEpTensors:
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(5)])
    return MoEEpTensors(
        torch.randn(5, H, generator=g).bfloat16(), ids, torch.rand(5, 2, generator=g)
    )


def _layer(stream: int) -> MoEEpLayer:
    boot = BootstrapConfig(1, 0, stream, init_method=f"tcp://127.0.0.1:{free_port()}")
    return MoEEpLayer(boot, FleetParams(E, 8, H), _pack(), "any_bf16_bf16_bf16_torch")


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, Any]]]:
    """(kernel method or the input check, the stream current while it ran) per call."""
    current: list[FakeExternalStream] = []
    calls: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def stream(s: FakeExternalStream | None) -> Iterator[None]:
        assert isinstance(s, FakeExternalStream)
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "ExternalStream", FakeExternalStream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    # this rank "has" CUDA device 0 (the stream's check at construction)
    monkeypatch.setattr(layer_module, "resolve_local_device", lambda b: 0, raising=False)
    for name in ("__init__", "stage_inputs", "compute_staged", "warmup", "destroy"):
        real = getattr(Bf16TorchKernel, name)

        def record(self: Any, *args: Any, _name: str = name, _real: Any = real, **kw: Any) -> Any:
            calls.append((_name, current[-1] if current else None))
            return _real(self, *args, **kw)

        monkeypatch.setattr(Bf16TorchKernel, name, record)
    real_check = layer_module.validate_forward

    def check(*args: Any) -> Any:
        calls.append(("validate_forward", current[-1] if current else None))
        return real_check(*args)

    monkeypatch.setattr(layer_module, "validate_forward", check)
    yield calls


def test_every_kernel_call_runs_on_the_configured_stream(seen: list[tuple[str, Any]]) -> None:
    layer = _layer(HANDLE)
    layer.warmup()
    out = layer(_inputs())
    layer.destroy()
    assert [name for name, _ in seen] == [
        "__init__",
        "warmup",
        "validate_forward",
        "stage_inputs",
        "compute_staged",
        "destroy",
    ]
    streams = {id(s) for _, s in seen}
    assert len(streams) == 1  # one ExternalStream per layer, made once
    s = seen[0][1]
    assert isinstance(s, FakeExternalStream)
    assert s.cuda_stream == HANDLE and s.device == torch.device("cpu")  # the runtime's device
    seen.clear()
    plain = _layer(0)
    try:
        assert torch.equal(plain(_inputs()), out)  # same result as with no stream
    finally:
        plain.destroy()
    assert {s for _, s in seen} == {None}  # stream 0: no stream context at all

"""Helpers shared by the backend tests: drop/cutlass skips, fresh-process runs, lifecycle fakes.

The GPU-only pieces of a pooled kernel (`_compile`, `_launch`) are faked on CPU; the
kernels' own logic (pooling, ref-counted release, staging, errors) runs for real.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack


def require_drop(drop: Any, *, cutlass: bool = True) -> None:
    """Skip unless `drop` is installed and materialized (and cutlass importable if asked)."""
    why = drop.reason()
    if why:
        pytest.skip(why)
    if cutlass and importlib.util.find_spec("cutlass") is None:
        pytest.skip("nvidia-cutlass-dsl is not installed (the drop's modules import cutlass)")


def run_fresh_python(code: str, *, timeout: float = 180) -> dict:
    """Run `code` in a fresh interpreter (the drops own top-level module names); its last
    stdout line parsed as JSON. Fails the test on a non-zero exit."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_compile_check(tmp_path: Path, module: str, arch: str, *args: str) -> dict:
    """`python -m <module> <args> --arch <arch>` with `CUTE_DSL_ARCH=<arch>` and a private
    CuTe DSL cache; its JSON result line (`ok` agrees with the exit code)."""
    env = {
        **os.environ,
        "CUTE_DSL_ARCH": arch,
        "CUTE_DSL_CACHE_DIR": str(tmp_path / "cute_cache"),
        "CUTE_DSL_NO_CACHE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", module, *args, "--arch", arch],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result line; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert (proc.returncode == 0) == result["ok"]
    return result


@dataclass
class FakeRuntime:
    """The parts of `moe_ep.runtime.Runtime` a kernel uses; counts barriers."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    barriers: int = 0

    def barrier(self) -> None:
        self.barriers += 1


def fake_gpu_pieces(
    monkeypatch: pytest.MonkeyPatch,
    cls: type,
    pool: Any,
    *,
    compile: Callable[..., Any],
    launch: Callable[..., Any],
) -> list[Any]:
    """Make `cls` available with `_compile` / `_launch` replaced; returns the list that
    records what `pool` frees."""
    freed: list[Any] = []
    monkeypatch.setattr(cls, "availability", classmethod(lambda c: (True, "")))
    monkeypatch.setattr(cls, "_compile", compile)
    monkeypatch.setattr(cls, "_launch", launch)
    monkeypatch.setattr(pool, "free", freed.append)
    return freed


def fake_cutedsl_gpu(
    monkeypatch: pytest.MonkeyPatch, cls: type, pool: Any
) -> tuple[list[Any], list[Any], list[Any]]:
    """`fake_gpu_pieces` for a CuTe DSL kernel: the fake `_compile` builds the staging
    buffers with core's `storage_tensor` from the kernel's own `_tensor_specs` (ids -1), the
    fake `_launch` writes output row r = r + 1 in every column. Returns the lists of compiled,
    launched and freed entries."""
    from moe_ep.backends.support.cutedsl.mega_kernel import STAGED, CompiledEntry, storage_tensor

    compiled: list[Any] = []
    launches: list[Any] = []

    def fake_compile(self: Any, g: Any) -> Any:
        specs = {s.name: s for s in self._tensor_specs(g)}
        staging = {
            name: storage_tensor(specs[name], lambda n: torch.empty(n, dtype=torch.uint8))
            for name in STAGED
        }
        staging["topk_idx"].fill_(-1)
        entry = CompiledEntry(None, torch.zeros(1), torch.zeros(1), staging, (), None, {})
        compiled.append(entry)
        return entry

    def fake_launch(self: Any, entry: Any) -> None:
        launches.append(entry)
        out = entry.staging["output_activation"]
        out.copy_((torch.arange(out.shape[0]) + 1.0)[:, None].expand_as(out))

    freed = fake_gpu_pieces(monkeypatch, cls, pool, compile=fake_compile, launch=fake_launch)
    return compiled, launches, freed


def assert_weights_match_their_specs(kernel: Any) -> None:
    """Every weight argument of a CuTe DSL `kernel`, reinterpreted as the launch does, has
    its spec's storage shape (fp4: two per byte along the leading dim), stride 1 on the
    spec's leading dim (what `mark_layout_dynamic` is told) and the spec's alignment."""
    from moe_ep.backends.support.cutedsl.mega_kernel import as_kernel_dtype

    weights = kernel._weight_tensors()
    specs = {s.name: s for s in kernel._tensor_specs(kernel.geometry)}
    assert set(weights) < set(specs)
    for name, tensor in weights.items():
        spec = specs[name]
        t = as_kernel_dtype(tensor, spec)
        shape = list(spec.shape)
        if spec.dtype == "fp4":
            shape[spec.leading_dim] //= 2
        assert list(t.shape) == shape, name
        assert t.stride(spec.leading_dim) == 1, name
        assert t.data_ptr() % spec.align == 0, name


def make_kernel(
    cls: type,
    config: Any,
    *,
    num_experts: int,
    intermediate: int,
    hidden: int,
    max_tokens: int,
    runtime: Any = None,
) -> Any:
    """`cls` over seeded bf16 weights `w13 [E, 2I, H]`, `w2 [E, H, I]` on a `FakeRuntime`."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=g).to(torch.bfloat16)
    w2 = torch.randn(num_experts, hidden, intermediate, generator=g).to(torch.bfloat16)
    return cls(
        config=config,
        fleet=FleetParams(
            num_experts=num_experts, max_tokens_per_rank=max_tokens, hidden_size=hidden
        ),
        runtime=runtime or FakeRuntime(),
        weights=MoEWeightPack(w13=w13, w2=w2),
    )


def routed_tensors(n: int, k: int, hidden: int, num_experts: int) -> MoEEpTensors:
    """Seeded inputs: `[n, hidden]` bf16 tokens, ids in [0, E) with one padded slot (row 0,
    column 1 = -1), fp32 weights."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, num_experts, (n, k), generator=g)
    ids[0, 1] = -1
    return MoEEpTensors(
        hidden_states=torch.randn(n, hidden, generator=g).to(torch.bfloat16),
        topk_ids=ids,
        topk_weights=torch.rand(n, k, generator=g),
    )


def assert_gpu_staging_equals_cpu(stage: Callable[..., Any], hidden: int, **kwargs: Any) -> None:
    """`stage(x, ids, weights, max_tokens=8, **kwargs)` on CUDA gives the CPU staging's bytes
    (activation, scales, ids, weights); skips without a CUDA device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (any arch); none visible")
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, hidden, generator=g) * 4).to(torch.bfloat16)
    ids = torch.randint(-1, 8, (6, 4), generator=g)
    w = torch.rand(6, 4, generator=g)
    cpu = stage(x, ids, w, max_tokens=8, **kwargs)
    gpu = stage(x.cuda(), ids.cuda(), w.cuda(), max_tokens=8, **kwargs)
    for name in ("activation", "activation_scales", "topk_ids", "topk_weights"):
        a, b = getattr(gpu, name).cpu(), getattr(cpu, name)
        if a.dtype.itemsize == 1:  # fp8 / packed fp4 / e8m0: compare bytes
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b), name


def assert_pull_availability_reasons(kernel_cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """An sm90 pull kernel's `availability()` names what is missing: no CUDA device here, a
    Blackwell GPU's capability (the kernels are built for sm_90a), an empty drop."""
    import moe_ep_sm90.common.pull_drop as pull_drop

    ok, why = kernel_cls.availability()
    assert not ok and "no CUDA device visible" in why
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "current_device", lambda: 0)
        m.setattr(torch.cuda, "get_device_capability", lambda d: (10, 0))
        m.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA B200")
        ok, why = kernel_cls.availability()
        assert not ok and "(NVIDIA B200) has compute capability 10.0; this kernel needs 9.0" in why
    with monkeypatch.context() as m:
        m.setattr(type(pull_drop.PULL_DROP), "reason", lambda self: "drop X is empty")
        ok, why = kernel_cls.availability()
        assert not ok and "drop X is empty" in why


def assert_padded_cells_zeroed(gpu: Any, layer: Any, forward: Callable[[Any], Any]) -> None:
    """With the recording fakes (`cute_fakes`): `forward(layer)` (3 tokens) zeroes the combine
    cells of padded slots before the launch and leaves the routed ones to the kernel."""
    layer.warmup()
    entry = layer._entry()
    cells, staging = entry.combine, entry.staging
    t, k = staging["topk_idx"].shape
    assert cells.shape == (t, k, staging["output_activation"].shape[1])
    assert cells.dtype == torch.bfloat16
    cells.fill_(3.0)
    seen: dict[str, torch.Tensor] = {}
    gpu.compiled.on_launch = lambda kwargs: seen.update(cells=cells.clone())
    forward(layer)
    ids = staging["topk_idx"][:3]
    assert (seen["cells"][:3][ids < 0] == 0).all() and (seen["cells"][:3][ids >= 0] == 3).all()
    layer.destroy()


def assert_layer_refuses_before_joining(
    kernel_cls: type,
    monkeypatch: pytest.MonkeyPatch,
    cases: list[tuple[FleetParams, MoEWeightPack, Any, str]],
    *,
    world_size: int,
    rank: int,
) -> None:
    """`MoEEpLayer` built with each case's `(fleet, weights, config)` raises `MoeEpUsageError`
    matching its pattern before it joins the group (the kernel made available, `acquire` a
    failure)."""
    import moe_ep.runtime
    from moe_ep import BootstrapConfig, MoEEpLayer
    from moe_ep.errors import MoeEpUsageError

    monkeypatch.setattr(kernel_cls, "availability", classmethod(lambda c: (True, "")))
    monkeypatch.setattr(moe_ep.runtime, "acquire", lambda *a, **k: pytest.fail("joined"))
    for fleet, weights, config, match in cases:
        with pytest.raises(MoeEpUsageError, match=match):
            MoEEpLayer(BootstrapConfig(world_size=world_size, rank=rank), fleet, weights, config)

"""The kernel cache on the launch path (`CutedslMegaKernel._compile` ->
`pooled_kernel.compile_collective`), on CPU: cutlass, NVSHMEM and the drop kernel are
`cute_fakes`' recording fakes, `cute.runtime.load_module` a recording loader; the cache
(`kernel_cache`, `cache_trust`) runs for real on a temporary directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from backend_testing import FakeRuntime, routed_tensors
from cute_fakes import (
    FakeCompiled,
    install_fake_pull_kernel,
)

import moe_ep.backends.support.cutedsl.kernel_cache as kernel_cache
import moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.kernel as pull
from moe_ep import cache_trust
from moe_ep.errors import MoeEpUnavailableError
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig as Config

H, I, E, T, K, WORLD, RANK = 256, 128, 4, 8, 2, 2, 1  # noqa: E741 - glossary names
OBJECT = b"\x7fELF compiled by the fake"


class Loaded(FakeCompiled):
    """What the recording loader returns: a compiled kernel that says where it came from."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    gpu = install_fake_pull_kernel(monkeypatch, world_size=WORLD, rank=RANK)
    monkeypatch.setattr(kernel_cache, "drop_digest", lambda kernel: "d" * 64)  # a test class
    gpu.compiled.dump_to_object = lambda prefix: OBJECT  # type: ignore[attr-defined]
    gpu.loads = []

    def load_module(path: str) -> dict[str, Any]:
        gpu.loads.append(path)
        return {kernel_cache._PREFIX: Loaded(path)}

    sys.modules["cutlass.cute"].runtime.load_module = load_module  # type: ignore[attr-defined]
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    gpu.root = tmp_path / "cache"
    monkeypatch.setenv("MOE_EP_CUTEDSL_CACHE", str(gpu.root))
    return gpu


def _layer() -> Any:
    el = E // WORLD
    return pull.Sm90Fp8Fp8Bf16PullCutedslKernel(
        config=Config(top_k=K),
        fleet=FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H),
        runtime=FakeRuntime(rank=RANK, world_size=WORLD),
        weights=MoEWeightPack(
            w13=torch.randn(el, 2 * I, H).to(torch.bfloat16),
            w2=torch.randn(el, H, I).to(torch.bfloat16),
        ),
    )


def _warm_and_forward() -> Any:
    """A layer warmed and run once, then destroyed (its pooled entry freed: the next layer
    compiles or loads again, as a new process does); returns its compiled kernel."""
    layer = _layer()
    layer.warmup()
    compiled = layer._pooled.compiled
    t = routed_tensors(3, K, H, E)
    layer.compute_staged(
        staged=layer.stage_inputs(tensors=t, output=torch.zeros(3, H, dtype=torch.bfloat16))
    )
    layer.destroy()
    return compiled


def _entries(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if not p.name.startswith(".")]


def test_second_construction_loads_the_first_ones_entry(gpu: Any) -> None:
    first = _warm_and_forward()
    assert first is gpu.compiled and len(gpu.compiles) == 1 and gpu.loads == []
    assert gpu.compiles[0][1]["options"] == "--gpu-arch sm_90a"
    [entry] = _entries(gpu.root)
    assert cache_trust.entry_problem(entry) is None
    assert (entry / "kernel.o").read_bytes() == OBJECT
    second = _warm_and_forward()
    assert len(gpu.compiles) == 1  # loaded, not compiled
    assert isinstance(second, Loaded) and second.path == str(entry / "kernel.o")
    assert len(second.launches) == 1 and len(first.launches) == 1  # the loaded one launched


def test_the_launch_key_is_the_compile_only_key(gpu: Any) -> None:
    _warm_and_forward()
    [entry] = _entries(gpu.root)
    kernel, args = gpu.compiles[0]
    key = json.loads((entry / "key.json").read_text())
    expected = kernel_cache.kernel_key(
        kernel,
        config=Config(top_k=K),
        geometry=_layer().geometry,
        arch="sm_90a",
        max_active_clusters=args["max_active_clusters"],
    )
    assert entry.name == expected.name and key == json.loads(expected.text())
    assert key["knobs"]["geometry"]["rank"] == RANK  # each rank its own entry


def test_a_corrupted_entry_is_rebuilt_not_loaded(gpu: Any) -> None:
    _warm_and_forward()
    [entry] = _entries(gpu.root)
    (entry / "kernel.o").write_bytes(b"\x7fELF flipped")  # the manifest no longer verifies
    assert cache_trust.entry_problem(entry) is not None
    assert _warm_and_forward() is gpu.compiled
    assert len(gpu.compiles) == 2 and gpu.loads == []
    assert cache_trust.entry_problem(entry) is None and (entry / "kernel.o").read_bytes() == OBJECT
    assert isinstance(_warm_and_forward(), Loaded)


def test_an_entry_of_another_key_is_never_loaded(gpu: Any) -> None:
    _warm_and_forward()
    [entry] = _entries(gpu.root)
    key = json.loads((entry / "key.json").read_text())
    (entry / "key.json").write_text(json.dumps({**key, "arch": "sm_100a"}))
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["sha256"]["key.json"] = cache_trust._sha256(entry / "key.json")
    (entry / "manifest.json").write_text(json.dumps(manifest))  # verifies: stale, not corrupt
    assert cache_trust.entry_problem(entry) is None
    assert _warm_and_forward() is gpu.compiled
    assert len(gpu.compiles) == 2 and gpu.loads == []
    assert json.loads((entry / "key.json").read_text()) == key


def test_without_the_variable_every_construction_compiles_as_before(
    gpu: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MOE_EP_CUTEDSL_CACHE")
    _warm_and_forward()
    _warm_and_forward()
    assert len(gpu.compiles) == 2 and gpu.loads == []
    assert all("options" not in args for _, args in gpu.compiles)  # the DSL picks the arch
    assert not gpu.root.exists()


def test_a_shared_cache_directory_is_refused_before_any_allocation(
    gpu: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("MOE_EP_CUTEDSL_CACHE", str(shared / "cutedsl"))
    with pytest.raises(MoeEpUnavailableError, match="writable by group and others"):
        _layer().warmup()
    assert gpu.symmetric == [] and gpu.compiles == []


def test_launch_arch_without_cute_dsl_arch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert kernel_cache.launch_arch(torch.device("cuda", 0)) == "sm_100a"
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert kernel_cache.launch_arch(torch.device("cuda", 0)) == "sm_90a"

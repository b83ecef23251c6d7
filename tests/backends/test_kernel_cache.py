"""The CuTe DSL kernel cache (`moe_ep.backends.support.cutedsl.kernel_cache`).

The key tests run here; the entry tests compile a small real CuTe DSL kernel for sm_90a in
child processes (the DSL reads `CUTE_DSL_ARCH` at import), so a second process really loads
what the first one built, with no GPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_ep import cache_trust
from moe_ep.backends.support.cutedsl import kernel_cache
from moe_ep.backends.support.launch_args import LaunchGeometry
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not installed"
)

GEOMETRY = LaunchGeometry(
    world_size=2,
    rank=0,
    max_tokens_per_rank=128,
    top_k=8,
    num_experts=8,
    hidden_size=1024,
    intermediate_size=512,
)

CONFIG_SOURCE = """
import dataclasses

@dataclasses.dataclass(frozen=True)
class Config:
    kernel_name: str = "sm90_bf16_bf16_bf16_pull_cutedsl"
    tile: tuple = (128, 64)
"""


def _package(tmp_path: Path, name: str, source: str) -> Path:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(source)
    return pkg


@pytest.fixture
def key_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """A drop kernel class under a lock (`drop_kc/`) and a config in its own package."""
    drop = tmp_path / "drop"
    drop.mkdir()
    (drop / "vendor.lock.json").write_text(json.dumps({"tree_sha256": "a" * 64}))
    _package(drop, "drop_kc", "class Kernel:\n    pass\n")
    _package(tmp_path, "backend_kc", CONFIG_SOURCE)
    monkeypatch.syspath_prepend(str(drop))
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in ("drop_kc", "backend_kc"):
        sys.modules.pop(m, None)
    import backend_kc  # type: ignore[import-not-found]
    import drop_kc  # type: ignore[import-not-found]

    yield drop_kc.Kernel(), backend_kc.Config(), drop, tmp_path / "backend_kc"
    for m in ("drop_kc", "backend_kc"):
        sys.modules.pop(m, None)


def test_key_changes_with_each_component(key_parts, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    kernel, config, drop, backend = key_parts

    def name(**over: object) -> str:
        k = kernel_cache.kernel_key(
            kernel,
            config=over.get("config", config),
            geometry=over.get("geometry", GEOMETRY),
            arch=str(over.get("arch", "sm_90a")),
        )
        assert k.drop == json.loads((drop / "vendor.lock.json").read_text())["tree_sha256"]
        return k.name

    base = name()
    assert name() == base  # the same inputs, the same entry
    assert base.startswith("sm90_bf16_bf16_bf16_pull_cutedsl-sm_90a-")
    changed = {
        "kernel name": name(
            config=dataclasses.replace(config, kernel_name="sm90_fp8_fp8_bf16_pull_cutedsl")
        ),
        "config knob": name(config=dataclasses.replace(config, tile=(128, 32))),
        "geometry": name(geometry=dataclasses.replace(GEOMETRY, hidden_size=2048)),
        "rank": name(geometry=dataclasses.replace(GEOMETRY, rank=1)),
        "arch": name(arch="sm_100a"),
    }
    (drop / "vendor.lock.json").write_text(json.dumps({"tree_sha256": "b" * 64}))
    changed["drop lock"] = name()
    (drop / "vendor.lock.json").write_text(json.dumps({"tree_sha256": "a" * 64}))
    assert name() == base
    (backend / "extra.py").write_text("X = 1\n")  # our wrapper code changed
    changed["our sources"] = name()
    (backend / "extra.py").unlink()
    assert name() == base
    real = kernel_cache._versions()
    assert {"nvidia-cutlass-dsl", "torch", "torch.version.cuda"} <= set(real)
    for dist in ("nvidia-cutlass-dsl", "cuda-bindings", "torch", "torch.version.cuda"):
        monkeypatch.setattr(kernel_cache, "_versions", lambda d=dist: {**real, d: "0.0.0"})
        changed[f"version of {dist}"] = name()
    monkeypatch.setattr(kernel_cache, "_versions", lambda: real)
    assert name() == base
    assert len(set(changed.values())) == len(changed) and base not in changed.values(), changed


def test_a_kernel_over_another_drops_class_is_keyed_by_both(tmp_path: Path, key_parts) -> None:  # type: ignore[no-untyped-def]
    drop = key_parts[2]
    other = tmp_path / "other_drop"
    other.mkdir()
    (other / "vendor.lock.json").write_text(json.dumps({"tree_sha256": "e" * 64}))
    (other / "derived_kc.py").write_text(
        "import drop_kc\nclass Derived(drop_kc.Kernel):\n    pass\n"
    )
    spec = importlib.util.spec_from_file_location("derived_kc", other / "derived_kc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["derived_kc"] = module
    try:
        spec.loader.exec_module(module)
        assert kernel_cache.drop_digest(module.Derived()) == "e" * 64 + "+" + "a" * 64
        (drop / "vendor.lock.json").write_text(json.dumps({"tree_sha256": "b" * 64}))
        assert kernel_cache.drop_digest(module.Derived()) == "e" * 64 + "+" + "b" * 64
    finally:
        sys.modules.pop("derived_kc", None)


def test_a_class_under_no_drop_lock_is_refused() -> None:
    with pytest.raises(RuntimeError, match="under no drop lock"):
        kernel_cache.drop_digest(GEOMETRY)


def test_cache_directory_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_EP_CUTEDSL_CACHE", raising=False)
    assert kernel_cache.kernel_cache_root() is None  # unset: every compile runs
    made = tmp_path / "made" / "cutedsl"
    monkeypatch.setenv("MOE_EP_CUTEDSL_CACHE", str(made))
    assert kernel_cache.kernel_cache_root() == made
    assert (made.stat().st_mode & 0o777) == 0o700
    assert (made.parent.stat().st_mode & 0o777) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by others, not sticky
    monkeypatch.setenv("MOE_EP_CUTEDSL_CACHE", str(shared / "cutedsl"))
    with pytest.raises(MoeEpUnavailableError, match="is writable by group and others"):
        kernel_cache.kernel_cache_root()
    assert not (shared / "cutedsl").exists()
    monkeypatch.setenv("MOE_EP_CUTEDSL_CACHE", str(shared))
    with pytest.raises(MoeEpUnavailableError, match=f"MOE_EP_CUTEDSL_CACHE='{shared}'"):
        kernel_cache.kernel_cache_root()
    monkeypatch.setenv("MOE_EP_CUTEDSL_CACHE", "relative/dir")
    with pytest.raises(MoeEpUsageError, match="MOE_EP_CUTEDSL_CACHE must be an absolute"):
        kernel_cache.kernel_cache_root()


CHILD = r"""
import json, sys, time
from pathlib import Path
import cutlass, cutlass.cute as cute
from cutlass.cute.typing import AddressSpace
from moe_ep.backends.support.cutedsl.kernel_cache import KernelKey, load_or_compile

@cute.kernel
def add_one(t: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    t[tidx] = t[tidx] + 1.0

@cute.jit
def launch(t: cute.Tensor):
    add_one(t).launch(grid=(1, 1, 1), block=(32, 1, 1))

root, knob = Path(sys.argv[1]), sys.argv[2]
key = KernelKey("probe", "d" * 64, "sm_90a", {"knob": knob}, {"v": "1"}, "c" * 64)
fake = cute.runtime.make_fake_tensor(
    cutlass.Float32, (cute.sym_int32(),), stride=(1,), memspace=AddressSpace.gmem,
    assumed_align=16,
)
compiled, hit = load_or_compile(
    key, lambda: cute.compile(launch, fake, options="--gpu-arch sm_90a"), root
)
print(json.dumps({"hit": hit, "type": type(compiled).__name__, "entry": key.name}))
"""


def _start(script: Path, root: Path, knob: str = "a") -> subprocess.Popen[str]:
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    return subprocess.Popen(
        [sys.executable, str(script), str(root), knob],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _run(script: Path, root: Path, knob: str = "a") -> dict[str, object]:
    return _result(_start(script, root, knob))


@pytest.fixture
def child(tmp_path: Path) -> tuple[Path, Path]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    return script, root


@needs_cutlass
def test_second_process_loads_the_first_ones_entry(child: tuple[Path, Path]) -> None:
    script, root = child
    first = _run(script, root)
    assert first["hit"] is False and first["type"] == "CudaDialectJitCompiledFunction"
    entry = root / str(first["entry"])
    assert cache_trust.entry_problem(entry) is None
    assert {p.name for p in entry.iterdir()} == {"key.json", "kernel.o", "manifest.json"}
    assert (entry.stat().st_mode & 0o777) == 0o700
    assert (entry / "kernel.o").read_bytes()[:4] == b"\x7fELF"
    second = _run(script, root)
    assert second == {**first, "hit": True}  # the same type, loaded without compiling
    assert _run(script, root, knob="b")["hit"] is False  # another key, another entry
    assert len([p for p in root.iterdir() if not p.name.startswith(".")]) == 2


def _rewrite(entry: Path, name: str, data: bytes) -> None:
    """Replace one file of an entry and re-record its manifest (a stale entry, not a
    corrupted one: the manifest verifies)."""
    (entry / name).write_bytes(data)
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["sha256"][name] = cache_trust._sha256(entry / name)
    (entry / "manifest.json").write_text(json.dumps(manifest))


@needs_cutlass
def test_corrupted_or_stale_entries_are_rebuilt_not_loaded(child: tuple[Path, Path]) -> None:
    script, root = child
    entry = root / str(_run(script, root)["entry"])
    good = (entry / "kernel.o").read_bytes()
    # corrupted: a flipped byte in the object, the manifest unchanged
    (entry / "kernel.o").write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    assert cache_trust.entry_problem(entry) is not None
    assert _run(script, root)["hit"] is False
    assert cache_trust.entry_problem(entry) is None and (entry / "kernel.o").read_bytes() == good
    # stale: an object the DSL refuses, recorded in the manifest
    _rewrite(entry, "kernel.o", b"\x7fELF not an object")
    assert cache_trust.entry_problem(entry) is None
    assert _run(script, root)["hit"] is False
    assert (entry / "kernel.o").read_bytes() == good
    # stale: an entry recorded for another key under this name
    key = json.loads((entry / "key.json").read_text())
    _rewrite(entry, "key.json", json.dumps({**key, "versions": {"v": "0"}}).encode())
    assert _run(script, root)["hit"] is False
    assert json.loads((entry / "key.json").read_text()) == key
    assert _run(script, root)["hit"] is True


@needs_cutlass
def test_two_processes_racing_on_one_key(child: tuple[Path, Path]) -> None:
    script, root = child
    procs = [_start(script, root) for _ in range(2)]
    results = [_result(p) for p in procs]
    assert results[0]["entry"] == results[1]["entry"]
    entry = root / str(results[0]["entry"])
    assert cache_trust.entry_problem(entry) is None
    assert [p.name for p in root.iterdir()] == [entry.name]  # no staging left behind
    assert _run(script, root)["hit"] is True


@needs_cutlass
def test_compile_check_warm_up_in_a_second_process(tmp_path: Path) -> None:
    """The measurement of docs/runtime.md (Kernel cache): the sm90 bf16 pull compile check
    run twice with the cache; the second process loads the first one's kernel."""
    root = tmp_path / "cache"
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "MOE_EP_CUTEDSL_CACHE": str(root)}
    cmd = [sys.executable, "-m", "moe_ep_sm90.compile_check", "bf16-pull", "--arch", "sm_90a"]
    runs = []
    for _ in range(2):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        entries = [p for p in root.iterdir() if not p.name.startswith(".")]
        assert [p.name.split("-")[0] for p in entries] == ["sm90_bf16_bf16_bf16_pull_cutedsl"]
        assert cache_trust.entry_problem(entries[0]) is None
    first, second = (r["seconds"] for r in runs)
    print(f"bf16 pull compile step: first process {first:.2f} s, second {second:.3f} s")
    assert runs[0]["detail"] == runs[1]["detail"] == "CudaDialectJitCompiledFunction"
    assert second < first / 10, runs

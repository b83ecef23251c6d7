"""The four real drops: verify, a no-op sync, the pre-commit guard, the shims, the wheels.

The session start (`tests/conftest.py`) materializes the drops; nothing here writes into the
checkout. Where they could not be materialized (no network), the tests that need them skip
with a reason naming the sync command.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from vendor_testlib import REPO, write_tree
from vendorlib import checks, templates
from vendorlib.lockfile import entries_of, write_lock
from vendorlib.meta import load_meta

from moe_ep.errors import MoeEpUnavailableError

DROPS = {
    "sm100_cutedsl_megamoe": ("moe_ep_drop_sm100_cutedsl", "moe-ep-drop-sm100-cutedsl-megamoe"),
    "sm100_next_cutedsl_megamoe": (
        "moe_ep_drop_sm100_next_cutedsl",
        "moe-ep-drop-sm100-next-cutedsl-megamoe",
    ),
    "sm90_pull_cutedsl": ("moe_ep_drop_sm90_pull", "moe-ep-drop-sm90-pull-cutedsl"),
    "sm90_pull_nvfp4": (
        "moe_ep_drop_sm90_pull_nvfp4",
        "moe-ep-drop-sm90-pull-nvfp4",
    ),
    "sm90_push_cuda": ("moe_ep_drop_sm90_push", "moe-ep-drop-sm90-push-cuda"),
    "sm90_push_cuda_deps": ("moe_ep_drop_sm90_push_cuda_deps", "moe-ep-drop-sm90-push-cuda-deps"),
}


def _tool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "tools/vendor.py", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def materialized() -> None:
    """Skip unless every drop is materialized (by the session start) and verifies."""
    bad = [d for d in sorted(DROPS) if not checks.verify(REPO, d)["ok"]]
    if bad:
        pytest.skip(
            f"vendored drop(s) {', '.join(bad)} not materialized or not as locked; run "
            "`uv run tools/vendor.py sync --all`"
        )


def test_sync_all_is_a_no_op_then_verify_all(materialized: None) -> None:
    before = {d: (REPO / "vendor" / d / "src").stat().st_ino for d in DROPS}
    proc = _tool("sync", "--all", "--json", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert {r["name"]: r["action"] for r in json.loads(proc.stdout)} == dict.fromkeys(
        DROPS, "up-to-date"
    )
    # not swapped in again: the same src/ directories
    assert {d: (REPO / "vendor" / d / "src").stat().st_ino for d in DROPS} == before
    proc = _tool("verify", "--all", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(proc.stdout)
    assert sorted(r["name"] for r in results) == sorted(DROPS)
    lock_counts = {
        d: json.loads((REPO / "vendor" / d / "vendor.lock.json").read_text())["file_count"]
        for d in DROPS
    }
    # counts of the 0.7.4 wheel's src/ trees (85 / 98 / 16 files in all, src/ only here)
    assert lock_counts == {
        "sm100_cutedsl_megamoe": 65,
        "sm100_next_cutedsl_megamoe": 46,
        "sm90_pull_cutedsl": 76,
        "sm90_pull_nvfp4": 3,  # FlashInfer's shim/nvfp4_{kernels,conversion,policy}.py
        "sm90_push_cuda": 7,
        "sm90_push_cuda_deps": 204,  # the nvcc -M closure of the push drop's includes
    }
    status = json.loads(_tool("status", "--json").stdout)
    for row in status:
        assert {"name", "materialized", "verified", "pending"} <= set(row)
        assert row["materialized"] and row["verified"] and row["pending"] == 0


def _guard_argv() -> list[str]:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}
    guard = hooks["vendor-guard"]
    assert guard["always_run"] is True and guard["pass_filenames"] is False
    argv = guard["entry"].split()
    assert argv[:2] == ["uv", "run"]
    return [sys.executable, *argv[2:]]  # the same command, in this interpreter


def test_guard_hook_fails_a_commit_that_edits_a_vendored_file(
    materialized: None, tmp_path: Path
) -> None:
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "tools", copy / "tools", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "vendor" / "sm90_push_cuda", copy / "vendor" / "sm90_push_cuda")
    shutil.copytree(REPO / "vendor" / "sm90_pull_cutedsl", copy / "vendor" / "sm90_pull_cutedsl")
    shutil.rmtree(copy / "vendor" / "sm90_pull_cutedsl" / "src")  # absent drops are skipped
    argv = _guard_argv()
    clean = subprocess.run(argv, cwd=copy, capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    target = copy / "vendor" / "sm90_push_cuda" / "src" / "a2a" / "sm90_push_a2a.cuh"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x20  # one flipped bit, as a stray local edit would
    target.write_bytes(bytes(data))
    dirty = subprocess.run(argv, cwd=copy, capture_output=True, text=True, timeout=120)
    assert dirty.returncode == 1
    assert "modified: a2a/sm90_push_a2a.cuh" in dirty.stdout


def _load_shim(drop: str, tmp_path: Path, with_src: bool) -> ModuleType:
    """A fresh copy of a drop's shim in a fake checkout, imported under a private name."""
    package, _ = DROPS[drop]
    fake = tmp_path / "vendor" / drop
    shutil.copytree(REPO / "vendor" / drop / "shim", fake / "shim")
    if with_src:
        tree = {"pkg/__init__.py": (0o644, b"VALUE = 42\n")}
        write_tree(fake / "src", tree)
        write_lock(fake / "vendor.lock.json", drop, {}, {}, entries_of(tree))
    else:
        shutil.copy(REPO / "vendor" / drop / "vendor.lock.json", fake / "vendor.lock.json")
    name = f"_shim_copy_{drop}_{with_src}"
    init = fake / "shim" / package / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        name, init, submodule_search_locations=[str(init.parent)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("drop", sorted(DROPS))
def test_shim_without_src_names_the_sync_command(drop: str, tmp_path: Path) -> None:
    shim = _load_shim(drop, tmp_path, with_src=False)
    ok, why = shim.availability()
    assert ok is False and f"uv run tools/vendor.py sync {drop}" in why
    assert shim.is_materialized() is False
    with pytest.raises(MoeEpUnavailableError, match=f"sync {drop}"):
        shim.src_dir()
    with pytest.raises(shim.DropUnavailableError):
        shim.import_src_module("common")


def test_shim_finds_in_repo_src_only_beside_a_lock(tmp_path: Path) -> None:
    shim = _load_shim("sm90_push_cuda", tmp_path, with_src=True)
    assert shim.src_dir() == (tmp_path / "vendor" / "sm90_push_cuda" / "src").resolve()
    assert shim.top_level_packages() == ("pkg",)
    assert [p.name for p in shim.source_files("**/*.py")] == ["__init__.py"]
    (tmp_path / "vendor" / "sm90_push_cuda" / "vendor.lock.json").unlink()
    assert shim.is_materialized() is False


@pytest.mark.parametrize("drop", sorted(DROPS))
def test_shims_and_build_hooks_are_generated_from_one_template(drop: str) -> None:
    """The four shims share one implementation: every file of each drop's shim package and
    its build hook is exactly what tools/vendorlib/templates.py generates for that drop."""
    package, _ = DROPS[drop]
    d = REPO / "vendor" / drop
    meta = load_meta(d)
    lock = json.loads((d / "vendor.lock.json").read_text())
    python_tree = any(
        f["path"].count("/") == 1 and f["path"].endswith(".py") for f in lock["files"]
    )
    want = templates.shim_files(drop, package, meta.description, python_tree)
    shim = d / "shim" / package
    assert sorted(p.name for p in shim.iterdir() if p.name != "__pycache__") == sorted(want)
    for rel, text in want.items():
        assert (shim / rel).read_text(encoding="utf-8") == text, rel
    assert (d / "hatch_build.py").read_text(encoding="utf-8") == templates.HATCH_BUILD


def test_one_cutedsl_drop_per_process(materialized: None) -> None:
    code = """
import sys
import moe_ep_drop_sm90_pull as pull, moe_ep_drop_sm100_cutedsl as sm100
from moe_ep.errors import MoeEpUsageError
mod = pull.import_src_module("common.megamoe_constants")
assert str(pull.src_dir()) in mod.__file__, mod.__file__
assert sys.path[0] == str(pull.src_dir())
assert type(mod.__loader__).__name__ == "VerifiedSourceLoader", mod.__loader__
try:
    sm100.activate()
except MoeEpUsageError as exc:
    print("refused:", exc)
"""
    shims = os.pathsep.join(str(REPO / "vendor" / d / "shim") for d in DROPS)
    env = {**os.environ, "PYTHONPATH": shims}  # works whether or not the members are installed
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused:" in proc.stdout and "moe_ep_drop_sm90_pull is already active" in proc.stdout


def test_a_drop_with_disjoint_names_activates_beside_the_one_it_imports(
    materialized: None,
) -> None:
    """The nvfp4 drop's namespace package `shim` imports the pull drop's `moe_hopper_fp8`:
    both active at once, every module through the verified loader; a drop sharing names with
    an active one (sm100 beside the pull drop) is still refused."""
    code = """
import sys
import moe_ep_drop_sm90_pull as pull, moe_ep_drop_sm90_pull_nvfp4 as nvfp4
import moe_ep_drop_sm100_cutedsl as sm100
from moe_ep.errors import MoeEpUsageError
assert nvfp4.top_level_packages() == ("shim",), nvfp4.top_level_packages()
pull.activate()
mod = nvfp4.import_src_module("shim.nvfp4_policy")
assert str(nvfp4.src_dir()) in mod.__file__, mod.__file__
assert type(mod.__loader__).__name__ == "VerifiedSourceLoader", mod.__loader__
assert sys.path[:2] == [str(nvfp4.src_dir()), str(pull.src_dir())], sys.path[:2]
try:
    sm100.activate()
except MoeEpUsageError as exc:
    print("refused:", exc)
"""
    shims = os.pathsep.join(str(REPO / "vendor" / d / "shim") for d in DROPS)
    env = {**os.environ, "PYTHONPATH": shims}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "refused:" in proc.stdout and "(common, moe_nvfp4_swapab, src)" in proc.stdout


@pytest.mark.parametrize("drop", sorted(DROPS))
def test_built_wheel_ships_exactly_the_locked_tree(
    materialized: None, drop: str, tmp_path: Path
) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH; the wheel check builds with `uv build`")
    package, dist = DROPS[drop]
    proc = subprocess.run(
        [uv, "build", "--package", dist, "-o", str(tmp_path), "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("*.whl")
    lock = json.loads((REPO / "vendor" / drop / "vendor.lock.json").read_text())
    prefix = f"{package}/_upstream/"
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n[len(prefix) :]: zf.read(n) for n in zf.namelist() if n.startswith(prefix)}
        assert f"{package}/__init__.py" in zf.namelist()
    assert sorted(shipped) == sorted(f["path"] for f in lock["files"])
    for f in lock["files"]:
        assert hashlib.sha256(shipped[f["path"]]).hexdigest() == f["sha256"]
    if drop == "sm90_push_cuda":
        assert {Path(p).suffix for p in shipped} == {".cu", ".cuh"}

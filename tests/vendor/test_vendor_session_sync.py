"""The session start (`tests/conftest.py`) on a checkout without the drops' `src/`.

A copy of this checkout (its git-listed files: what a clone with these edits holds, no
`src/`) runs a pytest session of its own, with the copy's packages and shims first on the
path. With no network and an empty cache, the run passes, every test that needs a drop skips
naming the sync command, and nothing is written into the copy. With the pinned artifact in
the cache, the session start materializes the drops and the tests in that same process use
them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest
from vendor_testlib import REPO
from vendorlib.drops import drop_names, load_drop
from vendorlib.sources import cache_dir

UNREACHABLE_INDEX = "http://127.0.0.1:9/simple"  # nothing listens on the discard port
SYNC = "tools/vendor.py sync"
# Helpers through which a test needs a drop's src/ (they skip naming the sync command).
DROP_HELPERS = ("require_drop(", "drop_signature(", "materialized: None")
# Reads a drop only through the registry's availability (the reason lists every cause).
ALSO_NEEDS_DROPS = (
    "tests/cli/test_cli_run_errors.py::test_gpu_kernel_on_cpu_is_unavailable_with_its_reason",
)


def modules_needing_drops() -> list[str]:
    """Test modules of this checkout that use a drop through the helpers, plus the known
    indirect tests (repository-relative)."""
    found = {
        p.relative_to(REPO).as_posix()
        for p in (REPO / "tests").rglob("test_*.py")
        if any(h in p.read_text(encoding="utf-8") for h in DROP_HELPERS)
    }
    found.discard(Path(__file__).relative_to(REPO).as_posix())
    return sorted(found | set(ALSO_NEEDS_DROPS))


def _copy_checkout(dest: Path) -> None:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout (the copy is made from `git ls-files`)")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.split(b"\0")
    for raw in filter(None, listed):
        rel = raw.decode()
        src = REPO / rel
        if src.is_file():  # a listed file another process just deleted is not copied
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _files(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


@dataclass
class Outcome:
    rc: int
    output: str
    results: dict[str, tuple[str, str]]  # node id -> (passed / skipped / failed, message)


def _run_session(copy: Path, cache: Path, args: list[str], tmp_path: Path) -> Outcome:
    paths = [*sorted(copy.glob("packages/*/src")), *sorted(copy.glob("vendor/*/shim"))]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(p) for p in paths),
        "MOE_EP_VENDOR_CACHE": str(cache),
        "MOE_EP_VENDOR_INDEX_URL": UNREACHABLE_INDEX,
    }
    xml = tmp_path / "junit.xml"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    proc = subprocess.run(
        [*argv, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=900
    )
    results: dict[str, tuple[str, str]] = {}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            node = f"{case.get('classname')}::{case.get('name')}"
            kind, message = "passed", ""
            for child in case:
                if child.tag in ("skipped", "failure", "error"):
                    kind, message = child.tag, child.get("message", "")
            results[node] = (kind, message)
    return Outcome(proc.returncode, proc.stdout + proc.stderr, results)


def test_offline_the_tests_that_need_drops_skip_naming_the_sync_command(tmp_path: Path) -> None:
    copy = tmp_path / "checkout"
    _copy_checkout(copy)
    assert not list(copy.glob("vendor/*/src"))
    before = _files(copy)
    modules = modules_needing_drops()
    out = _run_session(copy, tmp_path / "empty-cache", modules, tmp_path)
    assert out.rc == 0, out.output[-6000:]
    assert "could not materialize" in out.output and f"uv run {SYNC} --all" in out.output
    assert _files(copy) == before  # nothing materialized, nothing else written
    bad = {n: r for n, r in out.results.items() if r[0] in ("failure", "error")}
    assert not bad
    drop_skips = {
        n: msg
        for n, (kind, msg) in out.results.items()
        if kind == "skipped" and "materialized" in msg
    }
    assert all(SYNC in msg for msg in drop_skips.values()), drop_skips
    # the drops' own tests and the compile checks took the skip path (a missing drop)
    skipped_in = {n.split("::")[0].replace(".", "/") + ".py" for n in drop_skips}
    assert {
        "tests/vendor/test_vendor_real_drops.py",
        "tests/backends/test_sm90_compile.py",
        "tests/backends/test_sm100_compile.py",
    } <= skipped_in, skipped_in
    # the shims resolved to the copy, not to this checkout
    assert any(str(copy) in msg for msg in drop_skips.values())


def _cached_artifacts() -> list[Path]:
    paths = []
    for name in drop_names(REPO):
        pin = load_drop(REPO, name).meta.source
        if pin.kind != "pypi":
            pytest.skip(f"drop {name} is not pinned to a PyPI artifact")
        paths.append(cache_dir() / "pypi" / pin.fields["sha256"] / pin.fields["artifact"])
    return paths


def test_with_a_cached_artifact_the_session_materializes_and_uses_the_drops(
    tmp_path: Path,
) -> None:
    artifacts = _cached_artifacts()
    missing = [p for p in artifacts if not p.is_file()]
    if missing:
        pytest.skip(f"pinned artifact not cached ({missing[0]}); run `uv run {SYNC} --all`")
    cache = tmp_path / "cache"
    for artifact in set(artifacts):  # a private cache: this test never touches the real one
        target = cache / artifact.relative_to(cache_dir())
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(artifact, target)
    copy = tmp_path / "checkout"
    _copy_checkout(copy)
    before = _files(copy)
    nodes = [  # in this order: the first ones need the drops before any vendor test ran
        "tests/backends/test_sm100_launch_glue.py::test_kernel_constructor_matches_the_runner",
        *ALSO_NEEDS_DROPS,
        "tests/vendor/test_vendor_real_drops.py::test_sync_all_is_a_no_op_then_verify_all",
    ]
    out = _run_session(copy, cache, nodes, tmp_path)
    assert out.rc == 0, out.output[-6000:]
    assert f"materialized {len(drop_names(REPO))} in" in out.output, out.output[-3000:]
    kinds = {kind for kind, _ in out.results.values()}
    assert kinds == {"passed"}, out.results
    written = _files(copy) - before
    assert {Path(p).parts[:3] for p in written} == {("vendor", d, "src") for d in drop_names(REPO)}

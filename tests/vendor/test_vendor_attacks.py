"""Nothing planted runs: attacks on the drops, their shims and the vendor tool (issue #13).

Each test plants what an attacker (or a stray tool) could leave in a checkout, an installed
wheel, a VENDOR.md or a source, and checks that moe-ep never executes, deletes or silently
drops anything because of it. Planted modules write a marker file when they run, so "not
executed" is observed, not inferred.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import py_compile
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from vendor_testlib import (
    REPO,
    SUBDIR,
    TOOLS,
    UTILS_V3,
    V1,
    GitUpstream,
    Runner,
    git,
    sha256,
    snapshot,
    write_tree,
)
from vendorlib import ops
from vendorlib.progress import make_progress

PKG = "moe_ep_drop_demo"
# A Python tree (a top-level package), so the generated shim activates and imports it.
TREE: dict[str, tuple[int, bytes]] = {
    "pkg/__init__.py": (0o644, b""),
    # Room for a planted twin of the same size (a timestamp pyc records the source's size).
    "pkg/flag.py": (0o644, b'FLAG = "source"\n' + b"#" * 600 + b"\n"),
    "pkg/kernel.cu": (0o644, b"__global__ void k() {}\n"),
}


def _marker_code(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('planted code ran')\n"


def _add_path_drop(vendor: Runner, mirror: Path, tree: dict[str, tuple[int, bytes]]) -> Path:
    write_tree(mirror, tree)
    rc, out = vendor(
        "add", "demo", "--path", str(mirror), "--subdir", "", "--description", "demo",
        "--license", "MIT", "--consumer", "k",
    )  # fmt: skip
    assert rc == 0, out
    return Path(out["dir"])


def _python(code: str, path: list[Path]) -> dict[str, Any]:
    """Run `code` in a fresh interpreter with `path` first on sys.path; its last stdout line
    is JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


_IMPORT = """
import json, {pkg} as shim
ok, why = shim.availability()
out = {{"ok": ok, "why": why}}
try:
    mod = shim.import_src_module({module!r})
except shim.DropUnavailableError as exc:
    out["refused"] = str(exc)
else:
    out["file"] = mod.__file__
    out["flag"] = getattr(mod, "FLAG", None)
print(json.dumps(out))
"""


# --------------------------------------------------------------------------- bytecode


@pytest.mark.parametrize("mode", ["unchecked-hash", "timestamp"])
def test_planted_bytecode_in_src_is_not_executed(
    vendor: Runner, root: Path, tmp_path: Path, mode: str
) -> None:
    d = _add_path_drop(vendor, tmp_path / "mirror", TREE)
    source = d / "src" / "pkg" / "flag.py"
    marker = tmp_path / "ran"
    text = f"FLAG = 'planted'\n{_marker_code(marker)}".encode()
    st = source.stat()
    assert len(text) <= st.st_size, "the planted twin must fit in the locked file's size"
    planted = tmp_path / "planted.py"
    planted.write_bytes(text + b"#" * (st.st_size - len(text)))
    # TIMESTAMP: the default loader trusts a pyc whose header records the source's mtime and
    # size (the twin has both); UNCHECKED_HASH: it does not look at the source at all.
    os.utime(planted, ns=(st.st_atime_ns, st.st_mtime_ns))
    cfile = importlib.util.cache_from_source(str(source))
    py_compile.compile(
        str(planted), cfile=cfile, dfile=str(source), doraise=True,
        invalidation_mode=py_compile.PycInvalidationMode[mode.upper().replace("-", "_")],
    )  # fmt: skip
    # The attack is live: a plain import of the verified tree runs the planted bytecode.
    probe = _python(
        "import json, pkg.flag; print(json.dumps({'flag': pkg.flag.FLAG}))", [d / "src"]
    )
    assert probe["flag"] == "planted" and marker.exists()
    marker.unlink()
    cache = source.parent / "__pycache__"
    for pyc in cache.iterdir():  # keep only the planted file
        if str(pyc) != cfile:
            pyc.unlink()

    out = _python(_IMPORT.format(pkg=PKG, module="pkg.flag"), [d / "shim"])
    assert out["ok"], out
    assert out["flag"] == "source", out
    assert not marker.exists()
    # ... and the shim writes no bytecode into src/ either.
    assert [str(p) for p in cache.iterdir()] == [cfile]


# --------------------------------------------------------------------------- _upstream/


def test_planted_upstream_tree_in_a_checkout_is_not_imported(
    vendor: Runner, root: Path, tmp_path: Path
) -> None:
    d = _add_path_drop(vendor, tmp_path / "mirror", TREE)
    marker = tmp_path / "ran"
    planted = d / "shim" / PKG / "_upstream"
    write_tree(
        planted,
        {
            "pkg/__init__.py": (0o644, _marker_code(marker).encode()),
            "pkg/flag.py": (0o644, b'FLAG = "planted"\n'),
        },
    )
    out = _python(_IMPORT.format(pkg=PKG, module="pkg.flag"), [d / "shim"])
    assert not marker.exists(), out
    assert out["ok"] is False and "_upstream" in out["why"] and str(planted) in out["why"]
    assert "refused" in out and "_upstream" in out["refused"]
    # The guard reports it too: verify fails on a checkout carrying a shim _upstream/.
    rc, res = vendor("verify", "demo")
    assert rc == 1
    assert [(p["check"], p["path"]) for p in res[0]["problems"]] == [
        ("planted", f"shim/{PKG}/_upstream")
    ]
    shutil.rmtree(planted)
    out = _python(_IMPORT.format(pkg=PKG, module="pkg.flag"), [d / "shim"])
    assert out["ok"] and out["flag"] == "source", out
    assert out["file"] == str((d / "src" / "pkg" / "flag.py").resolve())
    assert vendor("verify", "demo")[0] == 0


@pytest.mark.parametrize("damage", ["modified", "extra", "symlink"])
def test_tampered_src_is_refused_by_the_shim(
    vendor: Runner, root: Path, tmp_path: Path, damage: str
) -> None:
    d = _add_path_drop(vendor, tmp_path / "mirror", TREE)
    marker = tmp_path / "ran"
    src = d / "src" / "pkg"
    if damage == "modified":
        (src / "flag.py").write_text('FLAG = "source"\n' + _marker_code(marker))
        module, rel = "pkg.flag", "pkg/flag.py"
    elif damage == "extra":
        (src / "evil.py").write_text(_marker_code(marker))
        module, rel = "pkg.evil", "pkg/evil.py"
    else:
        outside = tmp_path / "outside.py"
        outside.write_text(_marker_code(marker))
        (src / "flag.py").unlink()
        (src / "flag.py").symlink_to(outside)
        module, rel = "pkg.flag", "pkg/flag.py"
    out = _python(_IMPORT.format(pkg=PKG, module=module), [d / "shim"])
    assert not marker.exists(), out
    assert out["ok"] is False and rel in out["why"] and "sync demo" in out["why"], out
    assert rel in out["refused"]


_CHANGED_AFTER_VERIFY = """
import importlib, inspect, json, linecache, pathlib, {pkg} as shim
shim.activate()  # the tree verifies here
flag = pathlib.Path(shim.src_dir()) / "pkg" / "flag.py"
locked = flag.read_bytes()
flag.write_bytes(locked + {planted!r}.encode())  # changed after the check, before the import
out = {{}}
try:
    importlib.import_module("pkg.flag")
except ImportError as exc:
    out["refused"] = str(exc)
flag.write_bytes(locked)
mod = importlib.import_module("pkg.flag")
flag.write_bytes(b"FLAG = 'changed'\\n")  # inspect re-reads sources (the CuTe DSL does)
linecache.checkcache()
out["source_is_locked"] = inspect.getsource(mod) == locked.decode()
out["flag"] = mod.FLAG
print(json.dumps(out))
"""


def test_source_changed_after_verification_is_neither_imported_nor_shown(
    vendor: Runner, root: Path, tmp_path: Path
) -> None:
    d = _add_path_drop(vendor, tmp_path / "mirror", TREE)
    marker = tmp_path / "ran"
    code = _CHANGED_AFTER_VERIFY.format(pkg=PKG, planted=_marker_code(marker))
    out = _python(code, [d / "shim"])
    assert not marker.exists(), out
    assert "pkg/flag.py does not match its lock" in out["refused"], out
    assert out["flag"] == "source" and out["source_is_locked"] is True, out


# --------------------------------------------------------------------------- built wheels


@pytest.fixture(scope="module")
def pull_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built wheel of the sm90 pull drop (a Python tree)."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH; the wheel check builds with `uv build`")
    from vendorlib import checks

    if not checks.verify(REPO, "sm90_pull_cutedsl")["ok"]:
        pytest.skip("sm90_pull_cutedsl is not materialized; run `uv run tools/vendor.py sync`")
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run(
        [uv, "build", "--package", "moe-ep-drop-sm90-pull-cutedsl", "-o", str(out), "--quiet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = out.glob("*.whl")
    return wheel


def _install(wheel: Path, site: Path) -> Path:
    """Install a pure wheel the way an installer lays it out (plus the bytecode pip writes)."""
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(site)], check=True, timeout=300)
    return site / "moe_ep_drop_sm90_pull"


@pytest.mark.parametrize("damage", ["none", "modified", "extra", "no-lock"])
def test_installed_wheel_upstream_is_verified(
    pull_wheel: Path, tmp_path: Path, damage: str
) -> None:
    pkg = _install(pull_wheel, tmp_path / "site")
    upstream = pkg / "_upstream"
    marker = tmp_path / "ran"
    module = "common"
    if damage == "modified":
        init = upstream / "common" / "__init__.py"
        init.write_bytes(init.read_bytes() + b"\n" + _marker_code(marker).encode())
    elif damage == "extra":
        (upstream / "common" / "planted.py").write_text(_marker_code(marker))
        module = "common.planted"
    elif damage == "no-lock":
        (pkg / "_upstream.lock.json").unlink()
        (upstream / "common" / "__init__.py").write_text(_marker_code(marker))
    out = _python(_IMPORT.format(pkg="moe_ep_drop_sm90_pull", module=module), [tmp_path / "site"])
    if damage == "none":
        assert out["ok"] and out["why"] == str(upstream), out
        assert out["file"] == str(upstream / "common" / "__init__.py")
        return
    assert not marker.exists(), out
    assert out["ok"] is False and "refused" in out, out
    if damage == "no-lock":
        assert "_upstream.lock.json" in out["why"]
    else:
        assert f"common/{'__init__' if damage == 'modified' else 'planted'}.py" in out["why"]


# --------------------------------------------------------------------------- [[pending]] paths


def _drop_with_pending(vendor: Runner, tmp_path: Path) -> tuple[Path, Path]:
    d = _add_path_drop(vendor, tmp_path / "mirror1", V1)
    mirror2 = tmp_path / "mirror2"
    write_tree(mirror2, {**V1, "common/utils.py": (0o644, UTILS_V3)})
    rc, out = vendor(
        "pull-file", "demo", "common/utils.py", "--rev", str(mirror2), "--reason", "fix now"
    )
    assert rc == 0, out
    return d, mirror2


@pytest.mark.parametrize(
    "bad", ["../../victim.patch", "ABSOLUTE", "patches/../../../victim.patch", "SYMLINKED-DIR"]
)
def test_pending_patch_path_escaping_the_drop_is_refused(
    vendor: Runner, root: Path, tmp_path: Path, bad: str
) -> None:
    d, mirror2 = _drop_with_pending(vendor, tmp_path)
    good = "patches/common__utils.py.patch"
    victim = root / "victim.patch"
    victim.write_text("a file outside the drop\n")
    meta = d / "VENDOR.md"
    named = f"patch {good!r} resolves to"  # the message names the key, the value, the rule
    if bad == "SYMLINKED-DIR":
        outside = tmp_path / "outside"
        outside.mkdir()
        shutil.move(str(d / "patches" / "common__utils.py.patch"), outside)
        shutil.rmtree(d / "patches")
        (d / "patches").symlink_to(outside)
        victim = outside / "common__utils.py.patch"
    else:
        value = str(victim) if bad == "ABSOLUTE" else bad
        meta.write_text(meta.read_text().replace(f'patch = "{good}"', f"patch = {value!r}"))
        named = f"patch {value!r} is refused: it "
    before = snapshot(d)
    victim_bytes = victim.read_bytes()
    # sync --to a pin that already has the file absorbs the entry, deleting its patch.
    rc, res = vendor("sync", "demo", "--to", str(mirror2))
    assert rc == 2, res
    assert victim.read_bytes() == victim_bytes  # nothing outside the drop was deleted
    assert snapshot(d) == before
    assert named in res["error"] and "inside" in res["error"], res
    rc, res = vendor("verify", "demo")
    assert rc == 1 and any("patch" in p["detail"] for p in res[0]["problems"]), res


@pytest.mark.parametrize("bad", ["../VENDOR.md", "/etc/hostname", "common/../../VENDOR.md"])
def test_pending_file_path_escaping_the_tree_is_refused(
    vendor: Runner, root: Path, tmp_path: Path, bad: str
) -> None:
    d, _ = _drop_with_pending(vendor, tmp_path)
    meta = d / "VENDOR.md"
    meta.write_text(meta.read_text().replace('path = "common/utils.py"', f"path = {bad!r}"))
    rc, res = vendor("sync", "demo", "--force")
    assert rc == 2 and f"path {bad!r}" in res["error"] and "relative" in res["error"], res
    rc, res = vendor("verify", "demo")
    assert rc == 1 and f"path {bad!r}" in res[0]["problems"][0]["detail"], res


# --------------------------------------------------------------------------- atomic sync


@pytest.mark.parametrize("failing", ["write_lock", "write_meta"])
def test_sync_failing_midway_leaves_the_old_drop_and_no_staging(
    vendor: Runner,
    root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    failing: str,
) -> None:
    d = _add_path_drop(vendor, tmp_path / "mirror1", V1)
    mirror2 = tmp_path / "mirror2"
    write_tree(mirror2, {**V1, "common/utils.py": (0o644, UTILS_V3)})
    before = snapshot(d)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(f"disk full (simulated in {failing})")

    monkeypatch.setattr(ops, failing, broken)
    with pytest.raises(OSError, match="simulated"):
        ops.sync(root, "demo", make_progress(True), to=str(mirror2))
    assert snapshot(d) == before  # src/, lock and VENDOR.md all as they were
    assert not list(d.glob(".vendor-tmp-*"))
    monkeypatch.undo()
    assert vendor("verify", "demo")[0] == 0


def test_a_failed_commit_is_rolled_back(
    vendor: Runner, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vendorlib import staging

    d = _add_path_drop(vendor, tmp_path / "mirror1", V1)
    mirror2 = tmp_path / "mirror2"
    write_tree(mirror2, {**V1, "common/utils.py": (0o644, UTILS_V3)})
    before = snapshot(d)
    real = staging.exchange
    calls = {"n": 0}

    def flaky(a: Path, b: Path) -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # src/ and the lock are in; VENDOR.md fails
            raise OSError("rename failed (simulated)")
        real(a, b)

    monkeypatch.setattr(staging, "exchange", flaky)
    with pytest.raises(OSError, match="simulated"):
        ops.sync(root, "demo", make_progress(True), to=str(mirror2))
    assert calls["n"] > 3  # the two done swaps were undone
    assert snapshot(d) == before
    assert not list(d.glob(".vendor-tmp-*"))


_KILLED_SYNC = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tools!r})
from vendorlib import ops
from vendorlib.progress import make_progress
real, n = ops._write_file, [0]
def killer(path, mode, data):
    n[0] += 1
    if n[0] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, mode, data)
ops._write_file = killer
ops.sync(Path({root!r}), "demo", make_progress(True), to={to!r})
"""


def test_a_killed_sync_leaves_the_old_tree_and_the_next_sync_removes_its_staging(
    vendor: Runner, root: Path, tmp_path: Path
) -> None:
    d = _add_path_drop(vendor, tmp_path / "mirror1", V1)
    mirror2 = tmp_path / "mirror2"
    write_tree(mirror2, {**V1, "common/utils.py": (0o644, UTILS_V3)})
    before = snapshot(d)
    code = _KILLED_SYNC.format(tools=str(TOOLS), root=str(root), to=str(mirror2))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    left = list(d.glob(".vendor-tmp-*"))
    assert left  # SIGKILL runs no cleanup: the staging directory is still there
    assert {k: v for k, v in snapshot(d).items() if not k.startswith(".vendor-tmp-")} == before
    rc, res = vendor("sync", "demo")
    assert rc == 0 and res[0]["action"] == "up-to-date", res
    assert not list(d.glob(".vendor-tmp-*"))
    assert vendor("verify", "demo")[0] == 0


# --------------------------------------------------------------------------- sources


def _wheel_with_symlink(subdir: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        regular = zipfile.ZipInfo(f"{subdir}/ok.py")
        regular.external_attr = 0o100644 << 16
        zf.writestr(regular, "OK = 1\n")
        link = zipfile.ZipInfo(f"{subdir}/linked.py")
        link.external_attr = 0o120777 << 16  # S_IFLNK: the entry's data is the link target
        zf.writestr(link, "../../../etc/passwd")
        zf.writestr("evil-1.0.dist-info/METADATA", "Name: evil\nVersion: 1.0\n")
    return buf.getvalue()


def test_zip_symlink_entries_are_refused(
    vendor: Runner, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proj = tmp_path / "index" / "simple" / "evil"
    proj.mkdir(parents=True)
    name = "evil-1.0-py3-none-any.whl"
    data = _wheel_with_symlink("evil/src")
    (proj / name).write_bytes(data)
    (proj / "index.html").write_text(f'<a href="{name}#sha256={sha256(data)}">{name}</a>\n')
    monkeypatch.setenv("MOE_EP_VENDOR_INDEX_URL", (tmp_path / "index" / "simple").as_uri())
    rc, res = vendor(
        "add", "evil", "--pypi", "evil==1.0", "--subdir", "evil/src", "--description", "d",
        "--license", "MIT",
    )  # fmt: skip
    assert rc == 3, res
    assert "evil/src/linked.py" in res["error"] and "symlink" in res["error"]
    assert not (root / "vendor" / "evil").exists()


@pytest.mark.parametrize("target", ["outside", "inside"])
def test_symlinked_directories_of_a_path_source_are_refused(
    vendor: Runner, root: Path, tmp_path: Path, target: str
) -> None:
    mirror = tmp_path / "mirror"
    write_tree(mirror / "sub", V1)
    elsewhere = tmp_path / "elsewhere" if target == "outside" else mirror / "sub" / "common"
    write_tree(elsewhere, {"hidden.cu": (0o644, b"// hidden\n")})
    (mirror / "sub" / "linked").symlink_to(elsewhere, target_is_directory=True)
    rc, res = vendor(
        "add", "local", "--path", str(mirror), "--subdir", "sub", "--description", "d",
        "--license", "MIT",
    )  # fmt: skip
    assert rc == 3, res
    assert "linked" in res["error"] and "symlink" in res["error"]
    assert not (root / "vendor" / "local").exists()


def test_git_submodules_in_the_subdir_are_refused(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    # A gitlink (mode 160000) has no files in the tree: taking the rest would silently drop it.
    head = git_upstream.commits[-1]
    git(git_upstream.path, "update-index", "--add", "--cacheinfo", f"160000,{head},{SUBDIR}/sub")
    git(git_upstream.path, "commit", "-q", "-m", "c2: a submodule inside the subdir")
    rc, res = vendor(
        "add", "demo", "--git", str(git_upstream.path), "--subdir", SUBDIR,
        "--description", "d", "--license", "MIT",
    )  # fmt: skip
    assert rc == 3, res
    assert f"{SUBDIR}/sub is a submodule" in res["error"]
    assert not (root / "vendor" / "demo").exists()


# --------------------------------------------------------------------------- tool inputs


def test_a_lock_listing_a_path_outside_src_is_refused(
    vendor: Runner, root: Path, tmp_path: Path
) -> None:
    d = _add_path_drop(vendor, tmp_path / "mirror", TREE)
    lock_path = d / "vendor.lock.json"
    lock = json.loads(lock_path.read_text())
    lock["files"][0]["path"] = "../VENDOR.md"
    lock_path.write_text(json.dumps(lock))
    rc, res = vendor("verify", "demo")
    assert rc == 1 and "'../VENDOR.md' is refused" in res[0]["problems"][0]["detail"], res
    rc, res = vendor("sync", "demo", "--force")
    assert rc == 2 and "'../VENDOR.md' is refused" in res["error"], res


def test_lint_reports_a_shim_that_differs_from_the_template(
    vendor: Runner, root: Path, tmp_path: Path
) -> None:
    d = _add_path_drop(vendor, tmp_path / "mirror", TREE)
    assert vendor("lint", "demo")[0] == 0
    init_py = d / "shim" / PKG / "__init__.py"
    init_py.write_text(init_py.read_text().replace("PYTHON_TREE = ", "PYTHON_TREE = not "))
    (d / "hatch_build.py").write_text("# hand-edited\n")
    rc, res = vendor("lint", "demo")
    assert rc == 1
    assert sorted((p["check"], p["path"]) for p in res[0]["problems"]) == [
        ("generated", "hatch_build.py"),
        ("generated", f"shim/{PKG}/__init__.py"),
    ]


@pytest.mark.parametrize("atomic", [True, False])
def test_exchange_swaps_and_is_its_own_inverse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    from vendorlib import staging

    if atomic:
        if staging._renameat2() is None:
            pytest.skip("renameat2 is not available here (the fallback is tested)")
    else:
        monkeypatch.setattr(staging, "_atomic_exchange", lambda a, b: False)
    a, b, gone = tmp_path / "a", tmp_path / "b", tmp_path / "gone"
    write_tree(a, {"new.cu": (0o644, b"new\n")})
    write_tree(b, {"old.cu": (0o644, b"old\n")})
    staging.exchange(a, b)
    assert (b / "new.cu").read_bytes() == b"new\n"
    assert sorted(p.name for p in a.iterdir()) == ["old.cu"]
    staging.exchange(a, b)  # undo
    assert (a / "new.cu").is_file() and (b / "old.cu").is_file()
    staging.exchange(gone, b)  # one side missing: a rename, undone the same way
    assert not b.exists() and (gone / "old.cu").is_file()
    staging.exchange(gone, b)
    assert (b / "old.cu").is_file() and not gone.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no `.swap` left

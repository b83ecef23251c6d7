"""The vendor tool against a real git upstream: add, verify, sync, pending, diff, outdated."""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest
from vendor_testlib import (
    SUBDIR,
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
from vendorlib.lockfile import git_blob_id
from vendorlib.meta import load_meta
from vendorlib.progress import make_progress


def _add(vendor: Runner, up: GitUpstream, commit: str, name: str = "demo") -> dict:
    rc, out = vendor(
        "add", name, "--git", str(up.path), "--commit", commit, "--subdir", SUBDIR,
        "--description", "demo kernels", "--license", "MIT", "--license-file", "LICENSE",
        "--consumer", "sm90_fp8_fp8_bf16_push_cuda",
    )  # fmt: skip
    assert rc == 0, out
    return out


def test_add_writes_member_and_lock_matching_git(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    c0 = git_upstream.commits[0]
    out = _add(vendor, git_upstream, "HEAD~1")
    d = root / "vendor" / "demo"
    assert out["pin"]["commit"] == c0  # a ref is resolved to the full sha
    lock = json.loads((d / "vendor.lock.json").read_text())
    files = {f["path"]: f for f in lock["files"]}
    assert set(files) == set(V1)
    for rel, (mode, data) in V1.items():
        # independent expectation: git's own blob id and mode for the file at c0
        assert files[rel]["git_blob"] == git(git_upstream.path, "rev-parse", f"{c0}:{SUBDIR}/{rel}")
        assert files[rel]["sha256"] == sha256(data)
        assert files[rel]["mode"] == ("100755" if mode & 0o111 else "100644")
        assert (d / "src" / rel).read_bytes() == data
    assert os.access(d / "src" / "run.sh", os.X_OK)
    meta = load_meta(d)
    assert meta.source.fields["commit"] == c0 and meta.origin.commit == c0
    project = tomllib.loads((d / "pyproject.toml").read_text())
    assert project["project"]["name"] == "moe-ep-drop-demo"
    assert (d / "shim" / "moe_ep_drop_demo" / "__init__.py").is_file()
    assert "/src/" in (d / ".gitignore").read_text()
    rc, res = vendor("verify", "demo")
    assert rc == 0 and res[0]["ok"], res
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"


@pytest.mark.parametrize("damage", ["byte", "extra", "missing", "mode"])
def test_verify_detects_damage(
    vendor: Runner, root: Path, git_upstream: GitUpstream, damage: str
) -> None:
    _add(vendor, git_upstream, git_upstream.commits[0])
    src = root / "vendor" / "demo" / "src"
    if damage == "byte":
        data = bytearray((src / "a2a/push.cu").read_bytes())
        data[5] ^= 1
        (src / "a2a/push.cu").write_bytes(bytes(data))
        expect = ("modified", "a2a/push.cu")
    elif damage == "extra":
        (src / "a2a/new.cu").write_text("x\n")
        expect = ("extra", "a2a/new.cu")
    elif damage == "missing":
        (src / "tune/cfg.json").unlink()
        expect = ("missing", "tune/cfg.json")
    else:
        (src / "common/utils.py").chmod(0o755)
        expect = ("mode", "common/utils.py")
    rc, res = vendor("verify", "--all")
    assert rc == 1
    assert [(p["check"], p["path"]) for p in res[0]["problems"]] == [expect]


def test_verify_ignores_bytecode_but_not_other_files_in_pycache(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    _add(vendor, git_upstream, git_upstream.commits[0])
    cache = root / "vendor" / "demo" / "src" / "common" / "__pycache__"
    cache.mkdir()
    (cache / "utils.cpython-311.pyc").write_bytes(b"\0")
    assert vendor("verify", "demo")[0] == 0
    (cache / "note.txt").write_text("x")
    assert vendor("verify", "demo")[0] == 1


def test_sync_refuses_local_edits_then_force_restores(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    _add(vendor, git_upstream, git_upstream.commits[0])
    edited = root / "vendor" / "demo" / "src" / "common" / "utils.py"
    edited.write_text("local fix\n")
    rc, res = vendor("sync", "demo")
    assert rc == 1 and "local changes" in res["error"]
    assert edited.read_text() == "local fix\n"
    rc, res = vendor("sync", "demo", "--force")
    assert rc == 0 and res[0]["action"] == "materialized"
    assert edited.read_bytes() == V1["common/utils.py"][1]
    assert vendor("verify", "demo")[0] == 0


@pytest.mark.parametrize("edited", [False, True])
def test_sync_replaces_an_earlier_pins_bytes_left_by_a_merge_without_force(
    vendor: Runner, root: Path, git_upstream: GitUpstream, edited: bool
) -> None:
    # A checkout materialized at c0 merges a commit that re-pins the drop (lock, VENDOR.md):
    # its src/ still holds c0's bytes, which a lock in its history vouches for: no local edit.
    _add(vendor, git_upstream, git_upstream.commits[0])
    d = root / "vendor" / "demo"
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "drop at c0")
    old_src = snapshot(d / "src")
    (git_upstream.path / SUBDIR / "common" / "utils.py").write_bytes(UTILS_V3)
    c2 = git_upstream.commit("c2: utils fix")
    assert vendor("sync", "demo", "--to", c2)[0] == 0
    git(root, "commit", "-q", "-am", "re-pin to c2")
    shutil.rmtree(d / "src")
    write_tree(d / "src", old_src)  # what the merging checkout still has
    if edited:
        (d / "src" / "a2a" / "push.cu").write_text("a local fix\n")
    rc, res = vendor("sync", "demo")
    if edited:  # not the bytes of any earlier lock: refused, src/ left alone
        assert rc == 1 and "local changes" in res["error"]
        assert (d / "src" / "a2a" / "push.cu").read_text() == "a local fix\n"
        return
    assert rc == 0 and res[0]["action"] == "materialized", res
    assert (d / "src" / "common" / "utils.py").read_bytes() == UTILS_V3
    assert vendor("verify", "demo")[0] == 0
    assert git(root, "status", "--porcelain") == ""  # nothing tracked rewritten


def test_sync_materializes_missing_src_and_is_a_noop_when_clean(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    _add(vendor, git_upstream, git_upstream.commits[0])
    d = root / "vendor" / "demo"
    shutil.rmtree(d / "src")
    assert vendor("verify", "demo")[0] == 1
    before = snapshot(d)
    rc, res = vendor("sync", "--all")
    assert rc == 0 and res[0]["action"] == "materialized"
    assert vendor("verify", "demo")[0] == 0
    tracked = {k: v for k, v in snapshot(d).items() if not k.startswith("src/")}
    assert tracked == before  # a plain sync never rewrites VENDOR.md or the lock
    rc, res = vendor("sync", "demo")
    assert rc == 0 and res[0]["action"] == "up-to-date"


def test_pending_added_by_pull_file_then_absorbed_by_sync_to(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    _add(vendor, git_upstream, git_upstream.commits[0])
    (git_upstream.path / SUBDIR / "common" / "utils.py").write_bytes(UTILS_V3)
    (git_upstream.path / SUBDIR / "a2a" / "extra.cuh").write_text("// new\n")
    c2 = git_upstream.commit("c2: utils fix + new header")
    d = root / "vendor" / "demo"

    rc, res = vendor(
        "pull-file", "demo", "common/utils.py", "--rev", c2, "--reason", "fix needed now"
    )
    assert rc == 0 and res["action"] == "pending-added", res
    assert (d / "src/common/utils.py").read_bytes() == UTILS_V3
    meta = load_meta(d)
    (p,) = meta.pending
    assert (p.from_rev, p.to_rev) == (git_upstream.commits[0], c2)
    assert (p.from_sha256, p.to_sha256) == (sha256(V1["common/utils.py"][1]), sha256(UTILS_V3))
    assert (d / p.patch).is_file() and "+def g():" in (d / p.patch).read_text()
    assert vendor("verify", "demo")[0] == 0
    rc, rows = vendor("status")
    assert rows[0]["pending"] == 1 and rows[0]["verified"] is True

    # Re-materializing from the same pin re-applies the patch.
    shutil.rmtree(d / "src")
    assert vendor("sync", "demo")[0] == 0
    assert (d / "src/common/utils.py").read_bytes() == UTILS_V3

    rc, res = vendor("sync", "demo", "--to", c2)
    assert rc == 0 and res[0]["absorbed"] == ["common/utils.py"], res
    meta = load_meta(d)
    assert meta.pending == () and meta.source.fields["commit"] == c2
    assert not (d / p.patch).exists()
    assert (d / "src/a2a/extra.cuh").read_text() == "// new\n"
    lock = json.loads((d / "vendor.lock.json").read_text())
    assert lock["pin"]["commit"] == c2 and lock["pending"] == {}
    assert vendor("verify", "demo")[0] == 0


def test_patch_that_no_longer_reproduces(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    _add(vendor, git_upstream, git_upstream.commits[0])
    (git_upstream.path / SUBDIR / "common" / "utils.py").write_bytes(UTILS_V3)
    c2 = git_upstream.commit("c2")
    assert vendor("pull-file", "demo", "common/utils.py", "--rev", c2, "--reason", "r")[0] == 0
    d = root / "vendor" / "demo"
    patch = d / load_meta(d).pending[0].patch
    patch.write_text(patch.read_text().replace("-    return 1", "-    return 7"))
    rc, res = vendor("verify", "demo")
    assert rc == 1
    assert any("no longer reproduces" in p["detail"] for p in res[0]["problems"])
    before = snapshot(d)
    rc, res = vendor("sync", "demo", "--force")
    assert rc == 1 and "does not apply" in res["error"]
    assert snapshot(d) == before


def test_outdated_with_and_without_upstream_advances(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    c0, c1 = git_upstream.commits
    _add(vendor, git_upstream, c0)
    rc, res = vendor("outdated", "demo")  # head is c1: it changed only files outside the subdir
    assert rc == 0 and res[0]["ahead"] is False and res[0]["head"] == c1
    (git_upstream.path / SUBDIR / "common" / "utils.py").write_bytes(UTILS_V3)
    (git_upstream.path / SUBDIR / "tune" / "cfg.json").unlink()
    c2 = git_upstream.commit("c2")
    rc, res = vendor("outdated", "demo")
    assert rc == 1 and res[0]["head"] == c2
    assert res[0]["files"] == {
        "added": [],
        "removed": ["tune/cfg.json"],
        "modified": ["common/utils.py"],
    }
    assert vendor("sync", "demo", "--to", c2)[0] == 0
    rc, res = vendor("outdated", "demo")
    assert rc == 0 and res[0]["ahead"] is False


def test_diff_is_limited_to_the_subdir(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    c0, c1 = git_upstream.commits
    _add(vendor, git_upstream, c0)
    rc, res = vendor("diff", "demo")
    assert rc == 0 and res["identical"] and res["diff"] == ""
    rc, res = vendor("diff", "demo", "--against", c1)  # c1 touched README.md and docs/ only
    assert rc == 0 and res["identical"]
    (git_upstream.path / SUBDIR / "common" / "utils.py").write_bytes(UTILS_V3)
    (git_upstream.path / "README.md").write_text("changed again\n")
    git_upstream.commit("c2")
    rc, res = vendor("diff", "demo", "--head")
    assert rc == 1
    assert res["summary"]["modified"] == ["common/utils.py"]
    assert f"--- a/{SUBDIR}/common/utils.py" in res["diff"] and "README" not in res["diff"]
    assert "-def g():" in res["diff"]  # from head (has g) to src/ (does not)
    # local edit shows against the pin
    (root / "vendor/demo/src/run.sh").write_bytes(b"#!/bin/sh\necho edited\n")
    rc, res = vendor("diff", "demo")
    assert rc == 1 and res["summary"]["modified"] == ["run.sh"] and "+echo edited" in res["diff"]


def test_unknown_commit_and_unreachable_repo_exit_3(
    vendor: Runner, root: Path, git_upstream: GitUpstream, tmp_path: Path
) -> None:
    _add(vendor, git_upstream, git_upstream.commits[0])
    d = root / "vendor" / "demo"
    before = snapshot(d)
    rc, res = vendor("sync", "demo", "--to", "0123456789abcdef0123456789abcdef01234567")
    assert rc == 3 and "does not exist" in res["error"]
    assert snapshot(d) == before
    rc, res = vendor(
        "add", "gone", "--git", str(tmp_path / "no-such-repo"), "--subdir", SUBDIR,
        "--description", "x", "--license", "MIT",
    )  # fmt: skip
    assert rc == 3
    assert not (root / "vendor" / "gone").exists()
    rc, res = vendor(
        "add", "nosub", "--git", str(git_upstream.path), "--subdir", "no/such/dir",
        "--description", "x", "--license", "MIT",
    )  # fmt: skip
    assert rc == 3 and "missing or empty" in res["error"]
    assert not (root / "vendor" / "nosub").exists()


def test_interrupted_sync_leaves_the_old_tree(
    root: Path, vendor: Runner, git_upstream: GitUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    _add(vendor, git_upstream, git_upstream.commits[0])
    (git_upstream.path / SUBDIR / "common" / "utils.py").write_bytes(UTILS_V3)
    c2 = git_upstream.commit("c2")
    d = root / "vendor" / "demo"
    before = snapshot(d)
    real = ops._write_file
    calls = {"n": 0}

    def flaky(path: Path, mode: int, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated mid-copy)")
        real(path, mode, data)

    monkeypatch.setattr(ops, "_write_file", flaky)
    with pytest.raises(OSError, match="simulated"):
        ops.sync(root, "demo", make_progress(True), to=c2)
    assert calls["n"] == 3
    assert snapshot(d) == before  # old src/, lock and VENDOR.md intact; no staging left
    assert not list(d.glob(".vendor-tmp-*"))
    monkeypatch.setattr(ops, "_write_file", real)
    assert vendor("verify", "demo")[0] == 0


def test_sync_refuses_a_hand_edited_pin(
    vendor: Runner, root: Path, git_upstream: GitUpstream
) -> None:
    c0, c1 = git_upstream.commits
    _add(vendor, git_upstream, c0)
    meta = root / "vendor" / "demo" / "VENDOR.md"
    meta.write_text(
        meta.read_text().replace(f'commit = "{c0}"\nsubdir', f'commit = "{c1}"\nsubdir')
    )
    rc, res = vendor("verify", "demo")
    assert rc == 1 and [p["check"] for p in res[0]["problems"]] == ["pin"]
    rc, res = vendor("sync", "demo")
    assert rc == 1 and "--to <rev>" in res["error"]
    assert vendor("sync", "demo", "--to", c1)[0] == 0
    assert vendor("verify", "demo")[0] == 0

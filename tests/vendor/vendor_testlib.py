"""Helpers for the vendor tool tests: real upstreams (git repo, wheel + sdist on a file index,
plain directory) built in a temporary directory, and an in-process CLI runner."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"
if str(TOOLS) not in sys.path:
    sys.path.insert(0, str(TOOLS))


def _load_cli() -> Any:
    spec = importlib.util.spec_from_file_location("moe_ep_vendor_cli", TOOLS / "vendor.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CLI = _load_cli()

Runner = Callable[..., tuple[int, Any]]


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty repository root with vendor/, and a private artifact cache."""
    r = tmp_path / "repo"
    (r / "vendor").mkdir(parents=True)
    monkeypatch.setenv("MOE_EP_VENDOR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MOE_EP_VENDOR_INDEX_URL", raising=False)
    return r


@pytest.fixture
def vendor(root: Path, capsys: pytest.CaptureFixture[str]) -> Runner:
    """Run `vendor.py ARGS --root <root> --json --quiet` in-process: (exit code, parsed JSON)."""

    def run(*args: str) -> tuple[int, Any]:
        capsys.readouterr()
        rc = CLI.main([*args, "--root", str(root), "--json", "--quiet"])
        out = capsys.readouterr().out
        return rc, (json.loads(out) if out.strip() else None)

    return run


# --------------------------------------------------------------------------- upstream trees

SUBDIR = "kernels/src"
V1: dict[str, tuple[int, bytes]] = {
    "common/__init__.py": (0o644, b""),
    "common/utils.py": (0o644, b"# SPDX-License-Identifier: MIT\ndef f():\n    return 1\n"),
    "a2a/push.cu": (0o644, b"// SPDX-License-Identifier: MIT\n__global__ void k() {}\n"),
    "a2a/push.cuh": (0o644, b"#pragma once\n"),
    "tune/cfg.json": (0o644, b'{"tile": 128}\n'),
    "run.sh": (0o755, b"#!/bin/sh\necho run\n"),
    "LICENSE": (0o644, b"MIT License\n"),
}
UTILS_V3 = b"# SPDX-License-Identifier: MIT\ndef f():\n    return 2\n\n\ndef g():\n    return 3\n"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git(repo: Path, *args: str) -> str:
    env = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
        "HOME": str(repo),
        "PATH": "/usr/bin:/bin:/usr/local/bin",
    }
    proc = subprocess.run(
        ["git", *args], cwd=repo, env=env, capture_output=True, text=True, check=True
    )
    return proc.stdout.strip()


def write_tree(base: Path, tree: dict[str, tuple[int, bytes]]) -> None:
    for rel, (mode, data) in tree.items():
        p = base / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(mode)


@dataclass
class GitUpstream:
    path: Path
    commits: list[str]

    def commit(self, message: str) -> str:
        git(self.path, "add", "-A")
        git(self.path, "commit", "-q", "-m", message)
        sha = git(self.path, "rev-parse", "HEAD")
        self.commits.append(sha)
        return sha


@pytest.fixture
def git_upstream(tmp_path: Path) -> GitUpstream:
    """A git repo: c0 = the kernels under kernels/src plus files outside it; c1 changes only
    files outside the subdir. Tests add more commits with `.commit()`."""
    path = tmp_path / "upstream.git.src"
    path.mkdir()
    git(path, "init", "-q", "-b", "main")
    write_tree(path / SUBDIR, V1)
    (path / "README.md").write_text("upstream\n")
    up = GitUpstream(path, [])
    up.commit("c0: kernels")
    (path / "docs").mkdir()
    (path / "docs" / "notes.md").write_text("outside the subdir\n")
    (path / "README.md").write_text("upstream, edited\n")
    up.commit("c1: docs only")
    return up


# --------------------------------------------------------------------------- pypi index

DIST = "demo-kernels"
WHEEL_SUBDIR = "demo_kernels/kernel_src/sm90/x/src"


def _wheel_bytes(version: str, tree: dict[str, tuple[int, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("demo_kernels/__init__.py", "")
        for rel, (mode, data) in sorted(tree.items()):
            info = zipfile.ZipInfo(f"{WHEEL_SUBDIR}/{rel}")
            info.external_attr = (0o100000 | mode) << 16
            zf.writestr(info, data)
        zf.writestr(
            f"demo_kernels-{version}.dist-info/METADATA", f"Name: {DIST}\nVersion: {version}\n"
        )
    return buf.getvalue()


def _sdist_bytes(version: str, tree: dict[str, tuple[int, bytes]]) -> bytes:
    buf = io.BytesIO()
    top = f"demo_kernels-{version}"
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for rel, (mode, data) in sorted(tree.items()):
            info = tarfile.TarInfo(f"{top}/{WHEEL_SUBDIR}/{rel}")
            info.size = len(data)
            info.mode = mode
            tf.addfile(info, io.BytesIO(data))
        pkg = tarfile.TarInfo(f"{top}/PKG-INFO")
        meta = f"Name: {DIST}\nVersion: {version}\n".encode()
        pkg.size = len(meta)
        tf.addfile(pkg, io.BytesIO(meta))
    return buf.getvalue()


@dataclass
class PypiIndex:
    url: str
    files: dict[str, str]  # filename -> sha256


@pytest.fixture
def pypi_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PypiIndex:
    """A PEP 503 file index with a wheel and an sdist of demo-kernels 1.0 and 1.1
    (1.1 changes common/utils.py); MOE_EP_VENDOR_INDEX_URL points at it."""
    simple = tmp_path / "index" / "simple"
    proj = simple / DIST
    proj.mkdir(parents=True)
    v11 = dict(V1)
    v11["common/utils.py"] = (0o644, UTILS_V3)
    files: dict[str, str] = {}
    links = []
    for version, tree in (("1.0", V1), ("1.1", v11)):
        for name, data in (
            (f"demo_kernels-{version}-py3-none-any.whl", _wheel_bytes(version, tree)),
            (f"demo_kernels-{version}.tar.gz", _sdist_bytes(version, tree)),
        ):
            (proj / name).write_bytes(data)
            files[name] = sha256(data)
            links.append(f'<a href="{name}#sha256={files[name]}">{name}</a><br/>')
    (proj / "index.html").write_text("<html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    url = simple.as_uri()
    monkeypatch.setenv("MOE_EP_VENDOR_INDEX_URL", url)
    return PypiIndex(url, files)


def snapshot(path: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `path` (modes and bytes), to prove a failed command touched nothing."""
    return {
        p.relative_to(path).as_posix(): (p.stat().st_mode, p.read_bytes())
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }

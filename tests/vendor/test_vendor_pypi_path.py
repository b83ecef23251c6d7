"""The vendor tool against a PyPI-style index (wheel and sdist) and a plain directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vendor_testlib import (
    DIST,
    UTILS_V3,
    V1,
    WHEEL_SUBDIR,
    PypiIndex,
    Runner,
    snapshot,
    write_tree,
)
from vendorlib.meta import load_meta


def _add_pypi(vendor: Runner, name: str, *extra: str) -> tuple[int, Any]:
    return vendor(
        "add", name, "--pypi", f"{DIST}==1.0", "--subdir", WHEEL_SUBDIR,
        "--description", "demo", "--license", "MIT", "--consumer", "k", *extra,
    )  # fmt: skip


def test_wheel_and_sdist_give_the_same_tree(
    vendor: Runner, root: Path, pypi_index: PypiIndex
) -> None:
    rc, w = _add_pypi(vendor, "from_wheel")
    assert rc == 0, w
    rc, s = _add_pypi(vendor, "from_sdist", "--artifact", "demo_kernels-1.0.tar.gz")
    assert rc == 0, s
    assert w["pin"]["artifact"] == "demo_kernels-1.0-py3-none-any.whl"  # a wheel by default
    assert w["pin"]["sha256"] == pypi_index.files["demo_kernels-1.0-py3-none-any.whl"]
    assert s["pin"]["sha256"] == pypi_index.files["demo_kernels-1.0.tar.gz"]
    assert w["tree_sha256"] == s["tree_sha256"]
    for name in ("from_wheel", "from_sdist"):
        src = root / "vendor" / name / "src"
        assert {p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()} == set(V1)
        assert (src / "run.sh").stat().st_mode & 0o111
    rc, res = vendor("verify", "--all")
    assert rc == 0, res


def test_sync_to_new_version_and_outdated(
    vendor: Runner, root: Path, pypi_index: PypiIndex
) -> None:
    assert _add_pypi(vendor, "demo")[0] == 0
    rc, res = vendor("outdated", "demo")
    assert rc == 1 and res[0]["head"] == "1.1"
    assert res[0]["files"]["modified"] == ["common/utils.py"]
    rc, res = vendor("sync", "demo", "--to", "1.1")
    assert rc == 0, res
    d = root / "vendor" / "demo"
    meta = load_meta(d)
    assert meta.source.fields["version"] == "1.1"
    assert meta.source.fields["sha256"] == pypi_index.files["demo_kernels-1.1-py3-none-any.whl"]
    assert (d / "src/common/utils.py").read_bytes() == UTILS_V3
    assert json.loads((d / "vendor.lock.json").read_text())["pin"]["version"] == "1.1"
    assert vendor("verify", "demo")[0] == 0
    assert vendor("outdated", "demo")[0] == 0


def test_wrong_sha256_exits_3_and_leaves_the_drop(
    vendor: Runner, root: Path, pypi_index: PypiIndex
) -> None:
    assert _add_pypi(vendor, "demo")[0] == 0
    d = root / "vendor" / "demo"
    before = snapshot(d)
    rc, res = vendor("sync", "demo", "--to", "1.1", "--sha256", "0" * 64)
    assert rc == 3 and "sha256" in res["error"]
    assert snapshot(d) == before
    # A pinned sha256 that the downloaded bytes do not have (index lists no digest).
    index = Path(pypi_index.url.removeprefix("file://")) / DIST / "index.html"
    index.write_text(index.read_text().replace("#sha256=", "#md5="))
    rc, res = vendor("sync", "demo", "--to", "1.1", "--sha256", "1" * 64)
    assert rc == 3 and "sha256 is" in res["error"]
    assert snapshot(d) == before


def test_unreachable_index_exits_3_and_leaves_the_drop(
    vendor: Runner,
    root: Path,
    pypi_index: PypiIndex,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    assert _add_pypi(vendor, "demo")[0] == 0
    d = root / "vendor" / "demo"
    before = snapshot(d)
    monkeypatch.setenv("MOE_EP_VENDOR_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("MOE_EP_VENDOR_CACHE", str(tmp_path / "empty-cache"))
    rc, res = vendor("sync", "demo", "--force")
    assert rc == 3 and "cannot reach" in res["error"]
    assert snapshot(d) == before


def test_path_source_outdated_and_repin(vendor: Runner, root: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    write_tree(mirror / "sub", V1)
    rc, res = vendor(
        "add", "local", "--path", str(mirror), "--subdir", "sub", "--description", "d",
        "--license", "MIT", "--consumer", "k",
    )  # fmt: skip
    assert rc == 0, res
    assert vendor("outdated", "local")[0] == 0
    (mirror / "sub/common/utils.py").write_bytes(UTILS_V3)
    rc, res = vendor("outdated", "local")
    assert rc == 1 and res[0]["files"]["modified"] == ["common/utils.py"]
    rc, res = vendor("sync", "local", "--force")
    assert rc == 1 and "no longer reproduces the lock" in res["error"]
    rc, res = vendor("sync", "local", "--to", str(mirror))
    assert rc == 0
    assert (root / "vendor/local/src/common/utils.py").read_bytes() == UTILS_V3
    assert vendor("verify", "local")[0] == 0


def test_include_exclude_globs(vendor: Runner, root: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    write_tree(mirror, V1)
    rc, res = vendor(
        "add", "globbed", "--path", str(mirror), "--subdir", "", "--description", "d",
        "--license", "MIT", "--include", "**/*.cu*", "--include", "common/**",
        "--exclude", "**/*.cuh",
    )  # fmt: skip
    assert rc == 0, res
    src = root / "vendor/globbed/src"
    got = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    assert got == ["a2a/push.cu", "common/__init__.py", "common/utils.py"]


def test_lint_licenses_status_and_usage(vendor: Runner, root: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror"
    write_tree(mirror, V1)
    rc, res = vendor(
        "add", "lic", "--path", str(mirror), "--subdir", "", "--description", "d",
        "--license", "MIT", "--license-file", "LICENSE", "--consumer", "k",
    )  # fmt: skip
    assert rc == 0
    rc, res = vendor("licenses", "lic")
    assert rc == 0 and res[0]["headers"] == {"MIT": 2}
    assert sorted(res[0]["without_header"]) == sorted(
        p for p, (_, data) in V1.items() if b"SPDX-License-Identifier" not in data
    )
    d = root / "vendor" / "lic"
    meta_text = (d / "VENDOR.md").read_text()
    (d / "VENDOR.md").write_text(meta_text.replace('spdx = "MIT"', 'spdx = "Apache-2.0"'))
    rc, res = vendor("licenses", "lic")
    assert rc == 1 and {p["path"] for p in res[0]["problems"]} == {"common/utils.py", "a2a/push.cu"}
    (d / "VENDOR.md").write_text(meta_text)
    (d / "src" / "LICENSE").unlink()
    rc, res = vendor("verify", "lic")
    assert rc == 1 and {p["check"] for p in res[0]["problems"]} == {"missing"}
    rc, res = vendor("licenses", "lic")
    assert rc == 1 and res[0]["license_files"] == [{"path": "LICENSE", "present": False}]

    assert vendor("lint", "lic")[0] == 0
    (d / "patches").mkdir()
    (d / "patches" / "orphan.patch").write_text("")
    rc, res = vendor("lint", "--all")
    assert rc == 1 and res[0]["problems"][0]["path"] == "patches/orphan.patch"

    rc, rows = vendor("status")
    assert rc == 0
    assert [(r["name"], r["materialized"], r["verified"], r["pending"]) for r in rows] == [
        ("lic", True, False, 0)
    ]
    assert vendor("verify")[0] == 2  # neither names nor --all
    assert vendor("verify", "nope")[0] == 2
    assert vendor("sync", "lic", "--all")[0] == 2
    assert (
        vendor(
            "add",
            "x",
            "--pypi",
            "no-version",
            "--subdir",
            "s",
            "--description",
            "d",
            "--license",
            "MIT",
        )[0]
        == 2
    )
    (d / "VENDOR.md").write_text(meta_text.replace("schema = 1", "schema = 9"))
    rc, res = vendor("verify", "lic")  # verify reports a malformed front matter as a failed check
    assert rc == 1 and "schema = 9 unsupported" in res[0]["problems"][0]["detail"]
    rc, res = vendor("sync", "lic")  # other commands cannot work with it: usage error
    assert rc == 2 and "schema" in res["error"]

"""What every distribution ships beside its code: `py.typed`, the licence, and for the
vendored drops the upstream licence texts and a NOTICE.

The static checks read the repository; the wheel checks build each wheel with `uv build`
(hatchling from the package index or uv's cache: without either they skip with the reason)
and read it; the last one installs the wheels into a throwaway venv and runs `mypy --strict`
on a host script, as a user of the packages would.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = sorted(
    [".", *(str(p.parent.relative_to(ROOT)) for p in ROOT.glob("packages/*/pyproject.toml"))]
    + [str(p.parent.relative_to(ROOT)) for p in ROOT.glob("vendor/*/pyproject.toml")]
)
DROPS = [p for p in PROJECTS if p.startswith("vendor/")]
_SPDX_TOKEN = re.compile(r"[A-Za-z0-9.+-]+")


def _licence() -> bytes:
    """The project's licence, the root LICENSE."""
    return (ROOT / "LICENSE").read_bytes()


def _pyproject(project: str) -> dict[str, Any]:
    return tomllib.loads((ROOT / project / "pyproject.toml").read_text(encoding="utf-8"))


def _packages(project: str) -> list[str]:
    """Import packages the project's wheel ships (none for the meta package)."""
    wheel = _pyproject(project)["tool"]["hatch"]["build"]["targets"]["wheel"]
    return [Path(p).name for p in wheel.get("packages", [])]


def _package_dirs(project: str) -> list[Path]:
    wheel = _pyproject(project)["tool"]["hatch"]["build"]["targets"]["wheel"]
    return [ROOT / project / p for p in wheel.get("packages", [])]


def _spdx_ids(expression: str) -> set[str]:
    return {t for t in _SPDX_TOKEN.findall(expression) if t not in {"AND", "OR", "WITH"}}


def _front_matter(drop: str) -> dict[str, Any]:
    text = (ROOT / drop / "VENDOR.md").read_text(encoding="utf-8")
    return tomllib.loads(text.split("+++")[1])


def _licence_texts(drop: str) -> set[str]:
    return {p.stem for p in (ROOT / drop / "licenses").glob("*.txt")}


# -- the repository ---------------------------------------------------------------------------
def test_the_root_licence_is_the_apache_2_licence() -> None:
    assert _pyproject(".")["project"]["license"] == "Apache-2.0"
    text = _licence().decode("utf-8")
    assert text.lstrip().startswith("Apache License\n                           Version 2.0")
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply" in text


@pytest.mark.parametrize("project", PROJECTS)
def test_each_project_ships_the_licence_and_is_typed(project: str) -> None:
    meta = _pyproject(project)
    assert "LICENSE" in meta["project"]["license-files"], project
    assert (ROOT / project / "LICENSE").read_bytes() == _licence(), project
    assert "Apache-2.0" in _spdx_ids(meta["project"]["license"])
    for requirement in meta["build-system"]["requires"]:
        if requirement.startswith("hatchling"):
            assert requirement == "hatchling>=1.27", "PEP 639 license-files need 1.27"
    for package in _package_dirs(project):
        assert (package / "py.typed").is_file(), package


@pytest.mark.parametrize("drop", DROPS)
def test_each_drop_carries_its_upstream_licence_texts_and_a_notice(drop: str) -> None:
    meta = _pyproject(drop)
    texts = _licence_texts(drop)
    front = _front_matter(drop)
    declared = _spdx_ids(front["license"]["spdx"])
    assert declared <= texts, f"{drop}: no licenses/<id>.txt for {declared - texts}"
    assert _spdx_ids(meta["project"]["license"]) <= texts
    assert (ROOT / drop / "licenses" / "Apache-2.0.txt").read_bytes() == _licence()
    assert {"LICENSE", "NOTICE", "licenses/*.txt"} <= set(meta["project"]["license-files"])
    sdist = meta["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    assert {"/LICENSE", "/NOTICE", "/licenses"} <= set(sdist)  # wheels built from the sdist
    notice = (ROOT / drop / "NOTICE").read_text(encoding="utf-8")
    source = front["source"]
    for fact in (meta["project"]["name"], source["version"], source["sha256"], source["subdir"]):
        assert fact in " ".join(notice.split()), f"{drop}/NOTICE does not name {fact!r}"
    for stem in texts:
        assert f"licenses/{stem}.txt" in notice, f"{drop}/NOTICE does not say what {stem} covers"


@pytest.mark.parametrize("drop", DROPS)
def test_every_licence_a_drop_file_declares_has_its_text(drop: str) -> None:
    src = ROOT / drop / "src"
    if not src.is_dir():
        pytest.skip(f"{drop}/src is not materialized; run `uv run tools/vendor.py sync --all`")
    found: set[str] = set()
    for path in src.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts:
            head = path.read_bytes()[:8192].decode("utf-8", errors="replace")
            for m in re.finditer(r"SPDX-License-Identifier:\s*([A-Za-z0-9.+() -]+)", head):
                found |= _spdx_ids(m.group(1))
    assert found, drop
    assert found <= _licence_texts(drop), f"{drop}: headers name {found - _licence_texts(drop)}"


# -- the wheels ---------------------------------------------------------------------------------
def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH; the wheel checks build with `uv build`")
    return uv


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """project -> its wheel, built once per module (drops only when materialized)."""
    out = tmp_path_factory.mktemp("wheels")
    built: dict[str, Path] = {}
    for project in PROJECTS:
        if project in DROPS and not (ROOT / project / "src").is_dir():
            continue
        dest = out / project.replace("/", "_")
        proc = subprocess.run(
            [_uv(), "build", "--wheel", "--quiet", "-o", str(dest), str(ROOT / project)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode and (
            "build-system.requires" in proc.stderr or "Failed to fetch" in proc.stderr
        ):
            pytest.skip(
                "building a wheel needs hatchling>=1.27 from the package index or uv's cache, "
                f"neither reachable here: {proc.stderr.strip().splitlines()[-1]}"
            )
        assert proc.returncode == 0, proc.stderr
        (built[project],) = dest.glob("*.whl")
    return built


def _wheel(wheels: dict[str, Path], project: str) -> Path:
    if project not in wheels:
        pytest.skip(f"{project}/src is not materialized; run `uv run tools/vendor.py sync --all`")
    return wheels[project]


@pytest.mark.parametrize("project", PROJECTS)
def test_each_wheel_ships_py_typed_and_its_licence_files(
    wheels: dict[str, Path], project: str
) -> None:
    with zipfile.ZipFile(_wheel(wheels, project)) as zf:
        names = set(zf.namelist())
        (dist_info,) = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        for package in _packages(project):
            assert f"{package}/py.typed" in names, project
        licence_files = ["LICENSE"]
        if project in DROPS:
            licence_files += ["NOTICE", *(f"licenses/{s}.txt" for s in _licence_texts(project))]
        metadata = zf.read(f"{dist_info}/METADATA").decode("utf-8")
        for rel in licence_files:
            assert zf.read(f"{dist_info}/licenses/{rel}") == (ROOT / project / rel).read_bytes()
            assert f"License-File: {rel}" in metadata, (project, rel)


HOST_SCRIPT = """\
from moe_ep import BootstrapConfig, MoeEpUsageError
from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig
from moe_ep_sm100 import Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig
{drop_imports}
ok: int = BootstrapConfig(2, 1).world_size
error: MoeEpUsageError = MoeEpUsageError("x")
a: str = BootstrapConfig(2, 1).world_size  # wrong: int
b: str = Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig().swap_ab  # wrong: bool
c: str = Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig().input_norm_const  # wrong: float
{drop_lines}
"""


def test_mypy_strict_on_a_host_script_sees_every_package_s_types(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    """Installed from the wheels (no dependencies), each package's annotations reach mypy:
    the script's deliberate mistakes are reported, and no package is "missing library stubs
    or py.typed marker"."""
    pytest.importorskip("mypy")
    drops = [d for d in DROPS if d in wheels]
    shims = [_packages(d)[0] for d in drops]
    venv = tmp_path / "venv"
    uv = _uv()
    subprocess.run([uv, "venv", "--quiet", "-p", sys.executable, str(venv)], check=True)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    subprocess.run(
        [
            *(uv, "pip", "install", "--quiet", "--offline", "--no-deps", "-p", str(python)),
            *(str(w) for w in wheels.values()),
        ],
        check=True,
    )
    script = tmp_path / "host.py"
    script.write_text(
        HOST_SCRIPT.format(
            drop_imports="\n".join(f"import {s}" for s in shims) or "",
            drop_lines="\n".join(
                f"d{i}: str = {s}.is_materialized()  # wrong: bool" for i, s in enumerate(shims)
            ),
        ),
        encoding="utf-8",
    )
    (tmp_path / "mypy.ini").write_text("[mypy]\n", encoding="utf-8")
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--strict", "--no-incremental"),
            *("--config-file", "mypy.ini", "--python-executable", str(python), "host.py"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "py.typed" not in proc.stdout, proc.stdout
    lines = script.read_text(encoding="utf-8").splitlines()
    want = {i for i, line in enumerate(lines, 1) if "# wrong: " in line}
    assert len(want) == 3 + len(shims)
    got = {int(m.group(1)) for m in re.finditer(r"^host\.py:(\d+): error:", proc.stdout, re.M)}
    assert got == want, proc.stdout
    assert proc.stdout.count("Incompatible types in assignment") == len(want), proc.stdout

"""`benchmarks/gpu_carry.py`: the parts a GPU machine receives put back exactly what was
packed, refuse to unpack when one is missing or stale, and install only what is needed."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_carry.py"


@pytest.fixture(scope="module")
def carry() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_carry", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_carry"] = mod  # dataclass-free, but keep the import machinery happy
    spec.loader.exec_module(mod)
    return mod


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _packed(carry: ModuleType, tmp: Path, part_bytes: int) -> tuple[Path, dict[str, bytes]]:
    src = tmp / "repo"
    drop = src / "vendor" / "d1" / "src"
    (drop / "sub").mkdir(parents=True)
    (drop / "a.h").write_bytes(b"#pragma once\n" * 50)
    rng = random.Random(3)
    (drop / "sub" / "b.py").write_bytes(rng.randbytes(3000))  # incompressible: several parts
    wheels = tmp / "dl"
    wheels.mkdir()
    (wheels / "pkg_a-1.0-py3-none-any.whl").write_bytes(rng.randbytes(4000))
    (wheels / "pkg_b-2.1-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"PK" * 999)
    data = carry.build_tar(sorted(wheels.glob("*.whl")), ("d1",), src)
    parts = carry.split(data, part_bytes, tmp / "parts")
    assert len(parts) >= 3 and all(p.stat().st_size <= part_bytes for p in parts)
    expected = {f"vendor/d1/src/{k}": v for k, v in _tree(drop).items()}
    return tmp / "parts", expected | {f"wheels/{p.name}": p.read_bytes() for p in wheels.iterdir()}


def test_parts_reassemble_to_the_packed_wheels_and_drops(carry: ModuleType, tmp_path: Path) -> None:
    parts, expected = _packed(carry, tmp_path, part_bytes=2000)
    dest, wheels = tmp_path / "device_repo", tmp_path / "device_wheels"
    names = carry.assemble(parts, wheels, dest)
    assert names == sorted(k.removeprefix("wheels/") for k in expected if k.startswith("wheels/"))
    got = {f"wheels/{k}": v for k, v in _tree(wheels).items()} | _tree(dest)
    assert got == expected


def test_a_missing_part_is_named_and_nothing_is_unpacked(carry: ModuleType, tmp_path: Path) -> None:
    parts, _ = _packed(carry, tmp_path, part_bytes=2000)
    (parts / "part-01").unlink()
    with pytest.raises(SystemExit, match=r"parts \['part-01'\] of .* given back between calls"):
        carry.assemble(parts, tmp_path / "w", tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_a_stale_part_fails_the_checksum(carry: ModuleType, tmp_path: Path) -> None:
    parts, _ = _packed(carry, tmp_path, part_bytes=2000)
    p = parts / "part-00"
    data = p.read_bytes()
    p.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # e.g. a part left from an older pack
    with pytest.raises(SystemExit, match=r"sha256 .* a part is stale or torn"):
        carry.assemble(parts, tmp_path / "w", tmp_path / "r")


def test_only_missing_or_older_distributions_are_installed(
    carry: ModuleType, tmp_path: Path
) -> None:
    for name in (
        "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl",
        "cuda_core-1.2.2-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "cuda_pathfinder-1.9.1-py3-none-any.whl",
        "apache_tvm_ffi-0.1.15.post2-cp312-abi3-manylinux_2_28_x86_64.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    installed = {"cuda_core": "0.4.0", "cuda_pathfinder": "1.10.0", "apache_tvm_ffi": "0.1.15"}
    chosen = {w.name.split("-")[0]: why for w, why in carry.wheels_to_install(tmp_path, installed)}
    assert chosen == {
        "cuda_core": "cuda_core 1.2.2: replaces 0.4.0",
        "nvidia_cutlass_dsl_libs_cu13": "nvidia_cutlass_dsl_libs_cu13 4.8.1: not installed",
    }  # pathfinder 1.10.0 > 1.9.1 is kept; tvm-ffi 0.1.15 vs 0.1.15.post2: same release


def test_the_lock_pins_every_carried_runtime_wheel(carry: ModuleType) -> None:
    pins = carry.locked_versions(SCRIPT.parents[1] / "uv.lock", carry.LOCKED_WHEELS)
    assert set(pins) == set(carry.LOCKED_WHEELS)
    assert pins["nvidia-cutlass-dsl"] == pins["nvidia-cutlass-dsl-libs-cu13"]

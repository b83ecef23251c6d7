"""Compile-only checks of the sm90 kernels (no GPU needed).

The pull kernel is compiled for sm_90a with exactly the constructor and call arguments the
launch path builds (`moe_ep_sm90.pull_args`), in a fresh process per compile: the drop owns
generic top-level module names and the CuTe DSL reads its target arch from the environment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_ep_sm90.drops import PULL_DROP, PUSH_DROP


def _require_drop(drop) -> None:
    why = drop.reason()
    if why:
        pytest.skip(why)
    if importlib.util.find_spec("cutlass") is None and drop is PULL_DROP:
        pytest.skip("nvidia-cutlass-dsl is not installed (import cutlass)")


def _compile_pull(tmp_path: Path, arch: str, *extra: str) -> dict:
    env = {
        **os.environ,
        "CUTE_DSL_ARCH": arch,
        "CUTE_DSL_CACHE_DIR": str(tmp_path / "cute_cache"),
        "CUTE_DSL_NO_CACHE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "moe_ep_sm90.compile_check", "pull", "--arch", arch, *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result line; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert (proc.returncode == 0) == result["ok"]
    return result


def test_pull_kernel_compiles_for_sm90a(tmp_path):
    _require_drop(PULL_DROP)
    result = _compile_pull(tmp_path, "sm_90a")
    assert result["ok"], result
    assert result["arch"] == "sm_90a"
    assert result["detail"]  # the compiled-function type reported by cute.compile


def test_pull_kernel_refuses_a_blackwell_target(tmp_path):
    # The check means something: the same arguments for sm_100a fail (Hopper-only WGMMA).
    _require_drop(PULL_DROP)
    result = _compile_pull(tmp_path, "sm_100a")
    assert not result["ok"]
    assert "sm_90a" in result["error"]


@pytest.mark.slow
def test_pull_kernel_swap_ab_compiles_for_sm90a(tmp_path):
    _require_drop(PULL_DROP)
    result = _compile_pull(tmp_path, "sm_90a", "--swap-ab")
    assert result["ok"], result


def _push_include_dirs() -> tuple[Path, ...] | str:
    """Headers the push drop needs but does not ship, or the reason they are missing."""
    try:
        import tvm_ffi  # type: ignore[import-not-found]
    except ImportError:
        return "needs the apache-tvm-ffi headers (pip package apache-tvm-ffi<0.2, not in uv.lock)"
    tvm_inc = Path(tvm_ffi.__file__).parent / "include"
    dlpack = Path(tvm_ffi.__file__).parent / "3rdparty" / "dlpack" / "include"
    csrc = os.environ.get("MOE_EP_FLASHINFER_CSRC")
    if not csrc or not (Path(csrc) / "tvm_ffi_utils.h").is_file():
        return (
            "needs FlashInfer's tvm_ffi_utils.h (outside the drop): set MOE_EP_FLASHINFER_CSRC "
            "to the flashinfer/data/csrc directory of the flashinfer-python wheel"
        )
    # tvm_ffi_utils.h includes <flashinfer/layout.cuh> from the sibling data/include.
    return (tvm_inc, dlpack, Path(csrc), Path(csrc).parent / "include")


def test_push_a2a_unit_compiles_for_sm90a(tmp_path):
    _require_drop(PUSH_DROP)
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    includes = _push_include_dirs()
    if isinstance(includes, str):
        pytest.skip(includes)
    from moe_ep_sm90.compile_check import compile_push_a2a

    cubin, _ = compile_push_a2a(tmp_path, include_dirs=includes, nvcc=nvcc)
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    # ELF e_flags (offset 48, little endian): the SM number sits in bits 8..15.
    flags = int.from_bytes(data[48:52], "little")
    assert (flags >> 8) & 0xFF == 90

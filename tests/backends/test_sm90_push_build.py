"""The push modules' nvcc flags against the drop's own sources (CPU; nvcc preprocessor only).

A flag slip here compiles cleanly and fails only at the first GPU call, so the binding is
preprocessed with exactly the flags `build_modules` uses and the dtype checks it compiles
are read back.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from backend_testing import require_drop

from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.upstream import PUSH_DROP


def _require_push() -> None:
    require_drop(PUSH_DROP, cutlass=False)
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.upstream import PUSH_DEPS_DROP

    require_drop(PUSH_DEPS_DROP, cutlass=False)
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi is not installed")


def _preprocessed_binding(tmp_path: Path) -> str:
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    s = push_build.find_sources()
    cmd = push_build.binding_cubin_command(s, tmp_path / "gen", tmp_path / "x.cubin")
    i = cmd.index("-cubin")
    # The module's flags and includes, host preprocessing only (about 2 s).
    cmd = [*cmd[:i], "-E", "-Xcompiler", "-P", *cmd[i + 3 :]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_gemm_binding_accepts_fp8_e4m3_with_the_module_flags(tmp_path):
    # Without FLASHINFER_ENABLE_FP8_E4M3 (FlashInfer's JIT adds it to every module) the
    # binding's `is_fp8_e4m3fn` compiles to `return false` and every moe_gemm call raises
    # "input and weight must be float8_e4m3fn".
    _require_push()
    text = _preprocessed_binding(tmp_path)
    m = re.search(r"is_fp8_e4m3fn\(DLDataType\s*\w*\)\s*\{(.*?)\}", text, re.S)
    assert m, "is_fp8_e4m3fn not found in the preprocessed binding"
    body = m.group(1)
    assert "return false" not in body, body
    assert "float8_e4m3fn_code" in body, body


def test_every_flashinfer_switch_the_drop_tests_is_defined():
    # Each FLASHINFER_ENABLE_* the drop's sources test is defined for both modules.
    _require_push()
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    s = push_build.find_sources()
    used: set[str] = set()
    for path in sorted((s.drop_src).rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h"):
            used |= set(
                re.findall(
                    r"#\s*if(?:def|.*defined\()\s*\(?(FLASHINFER_ENABLE_\w+)", path.read_text()
                )
            )
    assert "FLASHINFER_ENABLE_FP8_E4M3" in used
    gemm = set(push_build.module_flags())
    a2a = set(push_build.a2a_library_command(s, Path("x.so")))
    for macro in sorted(used):
        assert f"-D{macro}" in gemm, macro
        assert f"-D{macro}" in a2a, macro


def test_gemm_link_finds_a_versioned_only_nvrtc_and_records_rpaths(tmp_path):
    # torch's cu13 wheel dir holds libnvrtc.so.13 but no libnvrtc.so: a plain -lnvrtc
    # cannot find it there, and nothing puts that dir on the loader's path at run time.
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    wheel = tmp_path / "nvidia" / "cu13" / "lib"
    wheel.mkdir(parents=True)
    (wheel / "libnvrtc.so.13").write_bytes(b"")
    (wheel / "libnvrtc-builtins.so.13.2").write_bytes(b"")
    tvm = tmp_path / "tvm_ffi" / "lib"
    s = _link_sources(tmp_path, tvm, wheel)
    flags = push_build._link_flags(s, driver=True)
    i = flags.index("-l:libnvrtc.so.13")
    assert flags[i - 1] == f"-L{wheel}"
    assert "-lnvrtc" not in flags
    for d in (wheel, tvm):
        j = flags.index(f"-rpath={d}")
        assert flags[j - 1] == "-Xlinker"
    (wheel / "libnvrtc.so").write_bytes(b"")  # a toolkit-style dir: the plain name wins
    assert "-lnvrtc" in push_build._link_flags(s, driver=True)
    assert not any("nvrtc" in f for f in push_build._link_flags(s, driver=False))


def test_libcuda_is_found_as_the_drivers_versioned_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # an image whose nvcc has no stubs dir and whose driver ships only libcuda.so.1
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "libcuda.so.1").write_bytes(b"")
    monkeypatch.setattr(push_build, "DRIVER_LIB_DIRS", [tmp_path / "absent", driver])
    s = _link_sources(tmp_path, tmp_path, None)
    toolkit = tmp_path / "toolkit"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_bytes(b"")
    monkeypatch.setattr(push_build.shutil, "which", lambda name: str(toolkit / "bin" / name))
    flags = push_build._link_flags(s, driver=True)
    assert flags[flags.index("-l:libcuda.so.1") - 1] == f"-L{driver}"
    assert "-lcuda" not in flags
    stubs = toolkit / "lib64" / "stubs"
    stubs.mkdir(parents=True)
    (stubs / "libcuda.so").write_bytes(b"")  # a toolkit with stubs: the stub wins
    flags = push_build._link_flags(s, driver=True)
    assert flags[flags.index("-lcuda") - 1] == f"-L{stubs}"


def _link_sources(tmp: Path, tvm_lib: Path, wheel_lib: Path | None) -> Any:
    """`PushSources` whose only real parts are the library dirs `_link_flags` reads."""
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    return push_build.PushSources(
        drop_src=tmp,
        deps_src=tmp,
        tvm_include=tmp,
        tvm_lib_dir=tvm_lib,
        cuda_wheel_includes=(),
        cuda_wheel_libs=() if wheel_lib is None else (wheel_lib,),
    )


def _touch(*paths: Path) -> None:
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")


def test_cuda_wheel_dirs_of_cuda13_and_cuda12_torch(tmp_path: Path) -> None:
    # torch cu13 wheels: one nvidia/cu13 tree; torch cu12 wheels (torch 2.8 cu128):
    # nvidia/<component>/{include,lib}, libnvrtc.so.12. Both must give cublasLt.h, nvrtc.h
    # and a linkable nvrtc (the GEMM module failed to compile on cu12 torch: no cublasLt.h).
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    cu13 = tmp_path / "a" / "nvidia"
    _touch(cu13 / "cu13" / "include" / "cublasLt.h", cu13 / "cu13" / "lib" / "libnvrtc.so.13")
    assert push_build.cuda_wheel_dirs([cu13]) == (
        (cu13 / "cu13" / "include",),
        (cu13 / "cu13" / "lib",),
    )
    cu12 = tmp_path / "b" / "nvidia"
    _touch(
        cu12 / "cu13" / "include" / "cuda.h",  # cuda-bindings' partial tree: not the wheels'
        cu12 / "cublas" / "include" / "cublasLt.h",
        cu12 / "cublas" / "lib" / "libcublasLt.so.12",
        cu12 / "cuda_nvrtc" / "include" / "nvrtc.h",
        cu12 / "cuda_nvrtc" / "lib" / "libnvrtc.so.12",
        cu12 / "curand" / "include" / "curand_kernel.h",
        cu12 / "cuda_runtime" / "include" / "cuda_runtime.h",  # nvcc's own must win
    )
    incs, libs = push_build.cuda_wheel_dirs([cu12])
    assert set(incs) == {cu12 / c / "include" for c in ("cublas", "cuda_nvrtc", "curand")}
    assert set(libs) == {cu12 / "cublas" / "lib", cu12 / "cuda_nvrtc" / "lib"}
    s = _link_sources(tmp_path, tmp_path / "tvm", None)
    s = push_build.PushSources(**{**vars(s), "cuda_wheel_includes": incs, "cuda_wheel_libs": libs})
    flags = push_build._link_flags(s, driver=True)
    assert flags[flags.index("-l:libnvrtc.so.12") - 1] == f"-L{cu12 / 'cuda_nvrtc' / 'lib'}"
    assert set(incs) <= set(s.system_include_dirs())
    assert push_build.cuda_wheel_dirs([tmp_path / "c" / "nvidia"]) == ((), ())


def test_every_gemm_module_source_finds_its_headers_in_the_drops(tmp_path: Path) -> None:
    # The deps drop is a header closure; a file it lacks stops the GEMM module's build on the
    # GPU machine (memoryUtils.cu needed cudaBf16Fallbacks.cuh, found 2026-12-01 once curand
    # headers were at hand). nvcc -M of each compile unit with the module's own flags and
    # include dirs; curand_kernel.h (CUDA toolkit, not a drop file) may be a stub here.
    _require_push()
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "curand_kernel.h").write_text("#pragma once\n")
    s = push_build.find_sources()
    gen = tmp_path / "gen"
    gen.mkdir()
    cmds = push_build.gemm_commands(s, gen, tmp_path, tmp_path / "m.so")[:-1]
    assert len(cmds) == 1 + len(push_build.COMMON_SOURCES)
    for cmd in cmds:
        i = cmd.index("-c")
        dep = [*cmd[:i], "-isystem", str(stub), "-M", cmd[i + 1]]
        proc = subprocess.run(dep, capture_output=True, text=True, timeout=180, check=False)
        assert proc.returncode == 0, f"{Path(cmd[i + 1]).name}: {proc.stderr[-1500:]}"

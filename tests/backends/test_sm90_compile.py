"""Compile-only checks of the sm90 kernels (no GPU needed).

The pull kernel is compiled for sm_90a with exactly the constructor and call arguments the
launch path builds (the pull kernel's `args`), in a fresh process per compile: the drop owns
generic top-level module names and the CuTe DSL reads its target arch from the environment.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from backend_testing import require_drop, run_compile_check

from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.upstream import PULL_DROP


def _require_drop(drop) -> None:
    require_drop(drop, cutlass=drop is PULL_DROP)


def _compile_pull(tmp_path: Path, arch: str, *extra: str) -> dict:
    return run_compile_check(tmp_path, "moe_ep_sm90.compile_check", arch, "pull", *extra)


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


def _require_push() -> None:
    from moe_ep.errors import MoeEpUnavailableError
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    try:
        push_build.find_sources()
    except MoeEpUnavailableError as exc:
        pytest.skip(str(exc))


def _elf_sm(cubin: Path) -> int:
    data = cubin.read_bytes()
    assert data[:4] == b"\x7fELF"
    # ELF e_flags (offset 48, little endian): the SM number sits in bits 8..15.
    return (int.from_bytes(data[48:52], "little") >> 8) & 0xFF


def test_push_a2a_unit_compiles_for_sm90a(tmp_path):
    _require_push()
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.compile import compile_push

    cubin, result = compile_push(tmp_path, "a2a")
    assert _elf_sm(cubin) == 90 and result.arch == "sm_90a"


@pytest.mark.slow
def test_push_binding_unit_compiles_for_sm90a(tmp_path):
    # The TVM-FFI binding + TRT-LLM fp8 block-scale GEMM unit (~60-90 s on 2 cores).
    _require_push()
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.compile import compile_push

    cubin, _ = compile_push(tmp_path, "binding")
    assert _elf_sm(cubin) == 90
    build_config = (tmp_path / "generated" / "fp8_moe_build_config.h").read_text()
    assert "FLASHINFER_SM90_PUSH_FP8_MOE_SOURCE_DIGEST" in build_config


def test_push_a2a_refuses_without_its_headers(tmp_path):
    # The check means something: without the deps drop's include dirs the unit does not
    # compile (tvm_ffi_utils.h lives outside the push drop).
    _require_push()
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    s = push_build.find_sources()
    cmd = push_build.a2a_cubin_command(s, tmp_path / "x.cubin")
    deps = str(s.deps_src)
    cut: list[str] = []
    skip = False
    for i, arg in enumerate(cmd):
        if skip:
            skip = False
        elif arg == "-isystem" and cmd[i + 1].startswith(deps):
            skip = True
        elif not arg.startswith(f"-I{deps}"):
            cut.append(arg)
    assert len(cut) < len(cmd)
    with pytest.raises(RuntimeError, match=r"tvm_ffi_utils\.h"):
        push_build.run(cut)


@pytest.mark.slow
def test_push_a2a_module_builds_and_loads_with_tvm_ffi(tmp_path):
    # Host + device build of the a2a TVM-FFI module (~40 s) and a load through tvm_ffi; the
    # one call made is the device == peer shortcut, which touches no GPU.
    _require_push()
    import tvm_ffi

    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    s = push_build.find_sources()
    out = tmp_path / "sm90_push_a2a.so"
    push_build.run(push_build.a2a_library_command(s, out))
    module = tvm_ffi.load_module(str(out))
    assert module.sm90_push_p2p_native_atomics(3, 3) is True
    for name in ("sm90_push_bump_tag", "sm90_push_wait_acks", "sm90_push_combine_fp8_grouped"):
        assert getattr(module, name) is not None

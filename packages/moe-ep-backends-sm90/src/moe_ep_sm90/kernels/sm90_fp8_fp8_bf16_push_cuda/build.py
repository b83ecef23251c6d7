"""Build the push drop's two TVM-FFI modules with nvcc, and the compile-only checks.

Inputs: the `sm90_push_cuda` drop (a2a + fp8 GEMM sources), the `sm90_push_cuda_deps` drop
(FlashInfer / TRT-LLM / CUTLASS headers and the five common sources the GEMM module links),
the `apache-tvm-ffi` headers, and cublasLt.h / nvrtc.h from torch's `nvidia-*` wheels (or
the CUDA toolkit). Flags and include directories follow FlashInfer's own JIT spec for these
modules (`push_style_megamoe/shim/{jit,gemm}.py` in the wheel).

Two uses:
- compile-only checks (no GPU): `a2a_cubin_command` / `binding_cubin_command` (device code,
  `-cubin`), run by `compile` (`python -m moe_ep_sm90.compile_check push-*`) and the tests;
- `build_modules` (shared libraries into a private, verified, content-addressed cache
  entry: `moe_ep.cache_trust`) and `load_modules`
  (`tvm_ffi.load_module`). Warning: no call into either module has ever run (they need a
  GPU). The a2a module builds and loads on CPU (`slow` test). The GEMM module's host build
  needs `curand_kernel.h` (torch 2.11's cu13 wheels ship it, the lock's 2.15 does not) and
  `libcuda`: it built on CPU once, against torch 2.11 with a stand-in `libcuda.so.1`
  (2026-12-01, docs/runbook.md), never with a real driver.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from moe_ep import cache_trust
from moe_ep.errors import MoeEpUnavailableError
from moe_ep_sm90 import env as push_env
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.upstream import PUSH_DEPS_DROP, PUSH_DROP

__all__ = [
    "COMMON_SOURCES",
    "BuiltModules",
    "PushSources",
    "a2a_cubin_command",
    "a2a_library_command",
    "binding_cubin_command",
    "build_modules",
    "cache_entry_name",
    "find_sources",
    "gemm_commands",
    "load_modules",
    "module_flags",
    "nvcc_version",
    "run",
    "source_digest",
    "toolchain_versions",
]

# FlashInfer's sm90a flags plus the GEMM module's own (shim/gemm.py `_module_flags`).
_SM90A = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED",
    "-DFLASHINFER_ENABLE_FP8_E8M0",
    "-DFLASHINFER_ENABLE_FP4_E2M1",
)
_GEMM_DEFINES = (
    "-DCOMPILE_HOPPER_TMA_GEMMS",
    "-DENABLE_BF16",
    "-DENABLE_FP8",
    "-DENABLE_FP8_BLOCK_SCALE",
    "-DCUTLASS_ENABLE_GDC_FOR_SM90=1",
)
_COMMON_CUDA = ("-std=c++17", "--compiler-options=-fPIC", "--expt-relaxed-constexpr")
# What FlashInfer's `gen_jit_spec` adds to every CUDA module (jit/core.py, release build).
# The dtype switches matter: without FLASHINFER_ENABLE_FP8_E4M3 the GEMM binding's
# `is_fp8_e4m3fn` is `return false` and every `moe_gemm` call refuses its fp8 inputs.
_FLASHINFER_CUDA = (
    "-use_fast_math",
    "-DFLASHINFER_ENABLE_F16",
    "-DFLASHINFER_ENABLE_BF16",
    "-DFLASHINFER_ENABLE_FP8_E4M3",
    "-DFLASHINFER_ENABLE_FP8_E5M2",
    "-DNDEBUG",
    "-O3",
)
# Sources under the deps drop's csrc/ linked into the GEMM module.
COMMON_SOURCES = (
    "nv_internal/cpp/common/envUtils.cpp",
    "nv_internal/cpp/common/logger.cpp",
    "nv_internal/cpp/common/stringUtils.cpp",
    "nv_internal/cpp/common/tllmException.cpp",
    "nv_internal/cpp/common/memoryUtils.cu",
)
_GEMM_SOURCES = (
    "fp8_moe_binding.cu",
    "fp8_moe_fc1_fused.cuh",
    "fp8_moe_jit.cuh",
    "fp8_moe_launcher.cuh",
    "fp8_moe_scheduler.cuh",
)


@dataclass(frozen=True)
class PushSources:
    """Where everything the push modules compile from lives on this machine."""

    drop_src: Path
    deps_src: Path
    tvm_include: Path
    tvm_lib_dir: Path
    cuda_wheel_includes: tuple[Path, ...]
    """Include dirs of torch's CUDA wheels (cublasLt.h, nvrtc.h, curand): `cuda_wheel_dirs`."""
    cuda_wheel_libs: tuple[Path, ...]

    @property
    def csrc(self) -> Path:
        return self.deps_src / "csrc"

    def gemm_include_dirs(self, gen_dir: Path) -> list[Path]:
        """-I dirs of the GEMM module, in FlashInfer's order (gen dir first)."""
        c = self.csrc
        trt = c / "nv_internal" / "tensorrt_llm"
        return [
            gen_dir,
            self.drop_src / "fp8_gemm",
            c,
            c / "nv_internal",
            c / "nv_internal" / "include",
            trt,
            trt / "cutlass_extensions" / "include",
            trt / "kernels" / "cutlass_kernels" / "include",
            trt / "kernels" / "cutlass_kernels",
        ]

    def system_include_dirs(self) -> list[Path]:
        dirs = [self.tvm_include, self.deps_src / "include", self.csrc]
        dirs.append(self.deps_src / "cutlass" / "include")
        dirs.extend(self.cuda_wheel_includes)
        return dirs

    def jit_include_dirs(self, gen_dir: Path) -> list[Path]:
        """Include dirs the run-time FC1 nvcc / FC2 NVRTC compiles need (the module's
        `set_deepgemm_jit_include_dirs`): the generated sources and `nv_internal/tensorrt_llm`.
        """
        return [gen_dir, self.csrc / "nv_internal" / "tensorrt_llm"]


def find_sources() -> PushSources:
    """Locate the drops, tvm-ffi and the CUDA wheel headers; `MoeEpUnavailableError` naming
    what is missing."""
    reasons = [r for r in (PUSH_DROP.reason(), PUSH_DEPS_DROP.reason()) if r]
    try:
        import tvm_ffi
    except ImportError:
        reasons.append("python package 'apache-tvm-ffi' (import tvm_ffi) is not installed")
    if reasons:
        raise MoeEpUnavailableError("; ".join(reasons))
    tvm_root = Path(tvm_ffi.__file__).parent
    try:
        import nvidia

        wheel_inc, wheel_lib = cuda_wheel_dirs([Path(p) for p in nvidia.__path__])
    except ImportError:
        wheel_inc, wheel_lib = (), ()
    return PushSources(
        drop_src=PUSH_DROP.module().src_dir(),
        deps_src=PUSH_DEPS_DROP.module().src_dir(),
        tvm_include=Path(tvm_ffi.libinfo.find_include_path()),
        tvm_lib_dir=tvm_root / "lib",
        cuda_wheel_includes=wheel_inc,
        cuda_wheel_libs=wheel_lib,
    )


CU12_COMPONENTS = ("cublas", "cuda_nvrtc", "curand")
"""The per-component wheels of a CUDA 12 torch whose headers / libraries the modules need
(not `cuda_runtime`: nvcc's own runtime headers must win)."""


def cuda_wheel_dirs(nvidia_roots: list[Path]) -> tuple[tuple[Path, ...], tuple[Path, ...]]:
    """(include dirs, library dirs) of torch's `nvidia-*` CUDA wheels under the `nvidia`
    namespace package's roots: the one `nvidia/cu13` tree of CUDA 13 wheels, else the
    per-component `nvidia/<component>` trees of CUDA 12 wheels; empty when neither holds
    cublasLt.h (the CUDA toolkit's own headers are then the only source)."""
    for root in nvidia_roots:
        if (root / "cu13" / "include" / "cublasLt.h").is_file():
            return (root / "cu13" / "include",), (root / "cu13" / "lib",)
    includes: list[Path] = []
    libs: list[Path] = []
    for root in nvidia_roots:
        includes += [
            root / c / "include" for c in CU12_COMPONENTS if (root / c / "include").is_dir()
        ]
        libs += [root / c / "lib" for c in CU12_COMPONENTS if (root / c / "lib").is_dir()]
    if not any((d / "cublasLt.h").is_file() for d in includes):
        return (), ()
    return tuple(includes), tuple(libs)


def module_flags(arch: str = "sm_90a") -> list[str]:
    """nvcc flags of the GEMM module for `arch` (FlashInfer's, with the arch substituted)."""
    gencode = f"-gencode=arch=compute_{arch[3:]},code={arch}"
    return [*_COMMON_CUDA, *_FLASHINFER_CUDA, gencode, *_SM90A[1:], *_GEMM_DEFINES]


def source_digest(s: PushSources, flags: list[str]) -> str:
    """sha256 over the GEMM sources, the deps drop's files and the flags (cache key; also
    the `FLASHINFER_SM90_PUSH_FP8_MOE_SOURCE_DIGEST` the run-time FC1 cache is keyed by)."""
    h = hashlib.sha256()
    files = [s.drop_src / "fp8_gemm" / n for n in _GEMM_SOURCES]
    files += [s.drop_src / "a2a" / n for n in ("sm90_push_a2a_ops.cu", "sm90_push_a2a.cuh")]
    files += sorted(p for p in s.deps_src.rglob("*") if p.is_file())
    for path in files:
        h.update(str(path.relative_to(path.parents[1])).encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    h.update(json.dumps(flags).encode())
    return h.hexdigest()


NVCC_VERSION_TIMEOUT_S = 60.0
"""Bound on `nvcc --version` (it answers in well under a second)."""
BUILD_ARCH = "sm_90a"
"""The arch both modules are built for (`build_modules`)."""


@functools.cache
def nvcc_version(nvcc: str) -> str:
    """`nvcc --version`'s output, read once per nvcc path and process (bounded by
    `NVCC_VERSION_TIMEOUT_S`); `MoeEpUnavailableError` naming the command when it is missing,
    fails or does not answer in time."""
    try:
        proc = subprocess.run(
            [nvcc, "--version"],
            capture_output=True,
            text=True,
            timeout=NVCC_VERSION_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        raise MoeEpUnavailableError(
            f"nvcc {nvcc!r} was not found: the sm90 push modules are built with the CUDA "
            "toolkit's nvcc (put it on PATH)"
        ) from None
    except OSError as exc:  # e.g. not executable
        raise MoeEpUnavailableError(f"nvcc {nvcc!r} cannot be run: {exc}") from None
    except subprocess.TimeoutExpired:
        raise MoeEpUnavailableError(
            f"{nvcc} --version did not answer within {NVCC_VERSION_TIMEOUT_S} s"
        ) from None
    if proc.returncode != 0 or not proc.stdout.strip():
        raise MoeEpUnavailableError(
            f"{nvcc} --version exited {proc.returncode} with no version: {proc.stderr[-2000:]}"
        )
    return proc.stdout.strip()


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def toolchain_versions(nvcc: str, arch: str = BUILD_ARCH) -> dict[str, str]:
    """What besides the sources decides the modules' bits: nvcc's `--version`, torch and
    its CUDA, the apache-tvm-ffi package ("absent" when not installed) and the arch."""
    import torch

    return {
        "nvcc": nvcc_version(nvcc),
        "torch": str(torch.__version__),
        "torch.version.cuda": str(torch.version.cuda),
        "apache-tvm-ffi": _package_version("apache-tvm-ffi"),
        "arch": arch,
    }


def cache_entry_name(s: PushSources, nvcc: str, arch: str = BUILD_ARCH) -> str:
    """The cache entry's name: 20 hex digits of sha256 over `source_digest` (sources and
    flags) and `toolchain_versions`, so another nvcc, torch, CUDA, tvm-ffi or arch gets
    another entry. The sources-only digest stays what the generated header carries."""
    h = hashlib.sha256(source_digest(s, module_flags(arch)).encode() + b"\0")
    h.update(json.dumps(toolchain_versions(nvcc, arch), sort_keys=True).encode())
    return h.hexdigest()[:20]


def write_build_config(gen_dir: Path, digest: str) -> Path:
    """The one-line generated header the GEMM sources require."""
    gen_dir.mkdir(parents=True, exist_ok=True)
    path = gen_dir / "fp8_moe_build_config.h"
    text = f'#pragma once\n\n#define FLASHINFER_SM90_PUSH_FP8_MOE_SOURCE_DIGEST "{digest[:20]}"\n'
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


def _includes(s: PushSources, local: list[Path]) -> list[str]:
    out = [f"-I{d}" for d in local]
    for d in s.system_include_dirs():
        out += ["-isystem", str(d)]
    return out


def a2a_cubin_command(s: PushSources, out: Path, *, arch: str = "sm_90a", nvcc: str = "nvcc"):
    """`nvcc -cubin` of `a2a/sm90_push_a2a_ops.cu` (device code only)."""
    src = s.drop_src / "a2a" / "sm90_push_a2a_ops.cu"
    flags = ["-std=c++17", f"-arch={arch}", *_SM90A[1:]]
    return [nvcc, *flags, *_includes(s, [src.parent]), "-cubin", "-o", str(out), str(src)]


def binding_cubin_command(
    s: PushSources, gen_dir: Path, out: Path, *, arch: str = "sm_90a", nvcc: str = "nvcc"
) -> list[str]:
    """`nvcc -cubin` of `fp8_gemm/fp8_moe_binding.cu` with the module's flags (~60 s)."""
    flags = module_flags(arch)
    write_build_config(gen_dir, source_digest(s, flags))
    src = s.drop_src / "fp8_gemm" / "fp8_moe_binding.cu"
    cuda = [f for f in flags if not f.startswith("-gencode")] + [f"-arch={arch}"]
    return [
        nvcc,
        *cuda,
        *_includes(s, s.gemm_include_dirs(gen_dir)),
        "-cubin",
        "-o",
        str(out),
        str(src),
    ]


def run(cmd: list[str], *, timeout: float = 600) -> float:
    """Run one compiler command; seconds taken. `RuntimeError` with its output on failure."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    return time.perf_counter() - start


@dataclass(frozen=True)
class BuiltModules:
    """The two shared libraries and the run-time JIT include dirs."""

    a2a: Path
    gemm: Path
    jit_include_dirs: tuple[Path, ...]


def default_cache_dir() -> Path:
    """`$MOE_EP_PUSH_CACHE` or `~/.cache/moe-ep/sm90_push`, private and checked
    (`moe_ep.cache_trust.cache_dir`)."""
    return cache_trust.cache_dir("MOE_EP_PUSH_CACHE", push_env.push_cache_dir(), "sm90_push")


DRIVER_LIB_DIRS = [
    Path("/usr/lib/x86_64-linux-gnu"),
    Path("/usr/lib/aarch64-linux-gnu"),
    Path("/usr/lib64"),
    Path("/usr/local/nvidia/lib64"),  # where container runtimes mount the driver
]
"""Where a driver's libcuda.so.1 lives when the toolkit's stubs dir has no libcuda.so."""


def _lib_flag(stem: str, dirs: list[Path]) -> list[str]:
    """`-L<dir> -l<stem>`, or `-L<dir> -l:lib<stem>.so.<N>` where `dir` holds only the
    versioned file (torch's CUDA wheels ship `libnvrtc.so.13` / `.so.12`, no `libnvrtc.so`);
    plain `-l<stem>` (nvcc's own library dirs) when no listed dir has it."""
    for d in dirs:
        if (d / f"lib{stem}.so").is_file():
            return [f"-L{d}", f"-l{stem}"]
        versioned = sorted(d.glob(f"lib{stem}.so.[0-9]*"), key=lambda p: len(p.name))
        if versioned:
            return [f"-L{d}", f"-l:{versioned[0].name}"]
    return [f"-l{stem}"]


def _link_flags(s: PushSources, *, driver: bool) -> list[str]:
    wheel = list(s.cuda_wheel_libs)
    flags = ["-shared", *(f"-L{d}" for d in wheel), f"-L{s.tvm_lib_dir}", "-ltvm_ffi", "-lcudart"]
    if driver:  # the GEMM module calls the driver API and NVRTC
        nvcc_root = Path(shutil.which("nvcc") or "nvcc").resolve().parents[1]
        # the toolkit's stub first; else the driver's own library, which an image without
        # the toolkit's stubs or a libcuda.so symlink has only as libcuda.so.1
        stubs = [nvcc_root / "lib64" / "stubs", nvcc_root / "lib64"]
        flags += _lib_flag("cuda", [*stubs, *DRIVER_LIB_DIRS])
        flags += _lib_flag("nvrtc", [*wheel, nvcc_root / "lib64"])
    # The loader finds libtvm_ffi / the wheel's CUDA libraries without LD_LIBRARY_PATH
    # (the wheel's libnvrtc is not loaded by torch before the module is).
    for d in (*wheel, s.tvm_lib_dir):
        flags += ["-Xlinker", f"-rpath={d}"]
    return flags


def a2a_library_command(s: PushSources, out: Path, *, nvcc: str = "nvcc") -> list[str]:
    """nvcc compile + link of the a2a module (host + sm_90a device code) into `out`."""
    src = s.drop_src / "a2a" / "sm90_push_a2a_ops.cu"
    return [
        nvcc,
        *_COMMON_CUDA,
        *_FLASHINFER_CUDA,
        *_SM90A,
        *_includes(s, [src.parent]),
        str(src),
        *_link_flags(s, driver=False),
        "-o",
        str(out),
    ]


def gemm_commands(
    s: PushSources, gen_dir: Path, build_dir: Path, out: Path, *, nvcc: str = "nvcc"
) -> list[list[str]]:
    """Compile commands of the GEMM module's six sources, then its link command."""
    flags = module_flags()
    write_build_config(gen_dir, source_digest(s, flags))
    sources = [s.drop_src / "fp8_gemm" / "fp8_moe_binding.cu"]
    sources += [s.csrc / c for c in COMMON_SOURCES]
    includes = _includes(s, s.gemm_include_dirs(gen_dir))
    cmds, objs = [], []
    for src in sources:
        obj = build_dir / (src.name + ".o")
        cmds.append([nvcc, *flags, *includes, "-c", str(src), "-o", str(obj)])
        objs.append(str(obj))
    gencode = [f for f in flags if f.startswith("-gencode")]
    cmds.append([nvcc, *gencode, *objs, *_link_flags(s, driver=True), "-o", str(out)])
    return cmds


def _built(s: PushSources, entry: Path) -> BuiltModules:
    return BuiltModules(
        entry / "sm90_push_a2a.so",
        entry / "sm90_push_fp8_moe_gemm.so",
        tuple(s.jit_include_dirs(entry / "generated")),
    )


def _build_entry(s: PushSources, nvcc: str, out: Path) -> None:
    """Both modules and the generated headers into the (private, staging) entry `out`."""
    built = _built(s, out)
    gen = out / "generated"
    gen.mkdir()
    # The run-time FC1 compile includes the GEMM headers from the generated dir.
    for name in _GEMM_SOURCES[1:]:
        shutil.copyfile(s.drop_src / "fp8_gemm" / name, gen / name)
    run(a2a_library_command(s, built.a2a, nvcc=nvcc))
    objects = out / "objects"
    objects.mkdir()
    for cmd in gemm_commands(s, gen, objects, built.gemm, nvcc=nvcc):
        run(cmd)
    shutil.rmtree(objects)


def build_modules(
    s: PushSources, cache_dir: Path | None = None, *, nvcc: str | None = None
) -> BuiltModules:
    """Compile and link both modules into the cache entry `<cache_dir>/<name>/` (name:
    `cache_entry_name`, over the sources, flags and toolchain versions), or
    reuse that entry when it passes the checks of `moe_ep.cache_trust` (private, every file
    matching its recorded sha256); `cache_dir` defaults to `default_cache_dir()` and is
    checked the same way. Ranks of one host may build at once: each builds privately and
    the entry appears whole, in one rename.

    The GEMM module needs `curand_kernel.h` (for `memoryUtils.cu`; torch 2.11's cu13 wheels
    or the toolkit) and `libcuda` to link; it built on CPU against torch 2.11 with a
    stand-in `libcuda.so.1`, never on a GPU machine. The a2a module's build runs on CPU in a
    `slow` test.

    Raises:
        MoeEpUsageError: `cache_dir` (or MOE_EP_PUSH_CACHE) is relative.
        MoeEpUnavailableError: the cache directory is not private (or HOME is unusable);
            nvcc is missing or `nvcc --version` fails.
        RuntimeError: a compile failed (its command and output).
    """
    nvcc = nvcc or shutil.which("nvcc") or "nvcc"
    if cache_dir is None:
        root = default_cache_dir()
    else:
        root = cache_trust.private_dir(cache_dir, origin=f"cache_dir={str(cache_dir)!r}")
    name = cache_entry_name(s, nvcc)
    entry = cache_trust.find_entry(root, name)
    if entry is None:
        staged = cache_trust.stage(root, name, lambda out: _build_entry(s, nvcc, out))
        entry = cache_trust.publish(staged, root / name)
    return _built(s, entry)


def load_modules(built: BuiltModules) -> tuple[object, object]:
    """(a2a module, GEMM module) through `tvm_ffi.load_module`; points the GEMM module's
    run-time JIT at its include dirs. Warning: NEVER RUN (needs a GPU)."""
    import tvm_ffi

    a2a = tvm_ffi.load_module(str(built.a2a))
    gemm = tvm_ffi.load_module(str(built.gemm))
    gemm.set_deepgemm_jit_include_dirs([str(d) for d in built.jit_include_dirs])
    return a2a, gemm

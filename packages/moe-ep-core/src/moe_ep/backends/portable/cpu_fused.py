"""Fused CPU epilogues of the portable kernels: SwiGLU, the top-k combine and the quantized
formats' FC2-input requantization in one pass each (and the expert GEMM of few rows).

The eager versions (`experts._swiglu`, `comm.combine`, `Recipe.requantize`) make one trip
through memory per torch op (widen, silu, multiply, round; gather, widen, weight, add per
slot, round; amax, scale, cast, decode, multiply). On CPU these stages cost as much as a
third of the expert GEMMs, so a small C library (`cpu_fused.c`, moe-ep's own) does each in
one pass with the same fp32 operations in the same order. It is compiled on first use with
the machine's C compiler (about a second), cached under `MOE_EP_CPU_FUSED_CACHE` (default
`~/.cache/moe-ep/cpu_fused`) by a digest of source, compiler, flags and CPU features, and
loaded with ctypes. The cache is private and every entry verified before it is loaded
(`moe_ep.cache_trust`); a cached library lacking a function the code binds is rebuilt. Rows
are split over `torch.get_num_threads()` OpenMP threads: built with `-fopenmp`, the library
binds to the `libgomp.so.1` torch already loaded, so it shares torch's thread pool (a
Python-thread split measured about 1.1x on 2 cores for a 1024-row block: the hand-off costs
as much as the work).

Results: the combine is bit-identical to the eager code; SwiGLU uses its own fp32 exp()
(about 1 ulp) where ATen uses SLEEF, so a rare bf16 output differs from eager by one last
bit. Both are deterministic and per row, so the bit-identity of the bf16 format across
world sizes holds as long as every rank uses the same path. The requantization
(`fake_quant`) gives the eager bits (NaN payloads aside).

`MOE_EP_CPU_FUSED`: `auto` (default; eager with one warning when no compiler works), `1`
(required: construction fails with `MoeEpUnavailableError` if it cannot build), `0` (eager).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import platform
import shutil
import subprocess
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from moe_ep import cache_trust, env
from moe_ep.errors import MoeEpUnavailableError
from moe_ep.quant import e8m0_to_float32

__all__ = [
    "SOURCE",
    "ExpertGroups",
    "PackedK16",
    "StoredWeight",
    "codes_unpackable",
    "combine",
    "exact_in_bf16",
    "expert_gemm",
    "library",
    "pack_k16",
    "pack_k16_codes",
    "parallel_workers",
    "run_single_threaded",
    "status",
    "swiglu",
]

SOURCE = Path(__file__).with_name("cpu_fused.c")
_MIN_ROWS_PER_THREAD = 16
"""Below this many rows per thread the split costs more than it saves."""

_i64, _f32, _i32, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int32, ctypes.c_void_p


_COMPILERS = ("cc", "gcc", "clang")


def _compiler() -> str | None:
    """The C compiler's path: `CC` when set (then only it), else the first of `_COMPILERS`."""
    cc = env.c_compiler()
    for name in [cc] if cc else _COMPILERS:
        if path := shutil.which(name):
            return path
    return None


def _no_compiler_reason() -> str:
    cc = env.c_compiler()
    if cc:
        return f"no C compiler found: CC={cc!r} is not an executable command; set CC to one"
    return (
        f"no C compiler found: CC is unset and none of {', '.join(_COMPILERS)} is on PATH; "
        "install one or set CC"
    )


def _arch_flags() -> list[str]:
    if platform.machine() in ("x86_64", "AMD64"):
        return ["-march=native", "-mprefer-vector-width=512"]
    return ["-mcpu=native"]


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return line
    return ""


# moe_ep_expert_gemm_v2: x, ld_x, x_kind, x_rows, groups, q_start, g_expert, out_row0, g_rows,
# alpha; w, w_expert_bytes, w_row_bytes, w_kind, s, s_expert_bytes, s_row_bytes, s_kind,
# s_block; out, ld_out, out_kind, n, k, xs, threads, vector
_EG_ROWS_ARGS = [_ptr, _i64, _i32, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr]
_EG_WEIGHT_ARGS = [_ptr, _i64, _i64, _i32, _ptr, _i64, _i64, _i32, _i64]
_EG_OUT_ARGS = [_ptr, _i64, _i32, _i64, _i64, _ptr, _i32, _i32]
_EG_X_SCALE_ARGS = [_ptr, _i64, _i64]
_SIGNATURES: dict[str, tuple[list[Any], Any]] = {
    "moe_ep_swiglu_bf16": (
        # gu, ld_gu, h, ld_h, rows, inter, has_alpha, alpha, has_clamp, clamp, threads
        [_ptr, _i64, _ptr, _i64, _i64, _i64, _i32, _f32, _i32, _f32, _i32],
        None,
    ),
    "moe_ep_combine_bf16": ([_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i32], None),
    "moe_ep_fake_quant": (
        # x, ld_x, out, ld_out, out_bf16, rows, cols, kind, block, norm_const, threads
        [_ptr, _i64, _ptr, _i64, _i32, _i64, _i64, _i32, _i64, _f32, _i32],
        None,
    ),
    "moe_ep_quant_e4m3": (
        # x, ld_x, codes, ld_codes, scales, ld_scales, rows, cols, kind, block, threads
        [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _i64, _i32, _i64, _i32],
        _i32,
    ),
    "moe_ep_expert_gemm_v2": ([*_EG_ROWS_ARGS, *_EG_WEIGHT_ARGS, *_EG_OUT_ARGS], _i32),
    # v2's arguments with x_scale, ld_x_scale, x_block after x_rows
    "moe_ep_expert_gemm_v3": (
        [
            *_EG_ROWS_ARGS[:4],
            *_EG_X_SCALE_ARGS,
            *_EG_ROWS_ARGS[4:],
            *_EG_WEIGHT_ARGS,
            *_EG_OUT_ARGS,
        ],
        _i32,
    ),
    # p, ld_p, sc, ld_sc, s_block, cols, k, dst, ld_dst, threads
    "moe_ep_widen_k16": ([_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64, _i32], None),
    "moe_ep_vector_bodies": ([], _i32),
    "moe_ep_omp_max_threads": ([], _i32),
    "moe_ep_omp_set_threads": ([_i32], None),
}
"""Every function the code calls, with its ctypes signature; a library lacking one is
rebuilt (a cached one) or refused (a fresh build)."""

NEWER_THAN_BASELINES = frozenset(
    {"moe_ep_fake_quant", "moe_ep_quant_e4m3", "moe_ep_expert_gemm_v3", "moe_ep_widen_k16"}
)
"""Functions an older `cpu_fused.c` (a benchmark's `--baseline-kernel`) may lack: on such a
library their callers run the eager code, as that commit did (`benchlib.baseline_kernel`)."""

_LIBRARY = "cpu_fused.so"
"""The library's file name inside its cache entry `cpu_fused-<digest>/`."""


def _open(path: Path, optional: frozenset[str] = frozenset()) -> tuple[ctypes.CDLL | None, str]:
    """(the library at `path` with every `_SIGNATURES` function it has bound, "") or (None,
    why): it must have all but the `optional` ones."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"{path} does not load: {exc}"
    present = {name for name in _SIGNATURES if hasattr(lib, name)}
    missing = [name for name in _SIGNATURES if name not in present and name not in optional]
    if missing:
        return None, f"{path} lacks {', '.join(missing)}"
    for name in present:
        argtypes, restype = _SIGNATURES[name]
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib, ""


def _compile(cc: str, flags: list[str], out_dir: Path) -> None:
    proc = subprocess.run(
        [cc, *flags, str(SOURCE), "-o", str(out_dir / _LIBRARY)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{cc} {' '.join(flags)}: {proc.stderr.strip()[-400:]}")


def _cached_or_built(cc: str, root: Path, optional: frozenset[str] = frozenset()) -> ctypes.CDLL:
    """The library from its verified cache entry under `root`, else a fresh build (then
    published there); `moe_ep.cache_trust` holds the rules. `optional`: functions it may
    lack (`NEWER_THAN_BASELINES`, for an older source).

    Tries the native arch with OpenMP first, then drops the arch flags, then OpenMP (a
    compiler without it gets the serial library)."""
    base = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", "-std=c11"]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False)
    same_for_all = [SOURCE.read_text(), cc, version.stdout, platform.machine(), _cpu_features()]
    errors = []
    for extra in ([*_arch_flags(), "-fopenmp"], ["-fopenmp"], []):
        flags = [*base, *extra]
        key = "\0".join([*same_for_all, *flags])
        name = f"cpu_fused-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        entry = cache_trust.find_entry(root, name)
        if entry is not None:
            lib, _ = _open(entry / _LIBRARY, optional)
            if lib is not None:
                return lib
        try:
            staged = cache_trust.stage(root, name, functools.partial(_compile, cc, flags))
        except RuntimeError as exc:
            errors.append(str(exc))
            continue
        # Loaded from the staging path: a new path and file, so never the copy a stale
        # entry of the same name left loaded in this process.
        lib, why = _open(staged / _LIBRARY, optional)
        if lib is None:
            cache_trust.discard(staged)
            raise RuntimeError(f"the fresh build is unusable: {why}")
        cache_trust.publish(staged, root / name, replace=entry is not None)
        return lib
    raise RuntimeError("; ".join(errors))


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    mode = env.cpu_fused_mode()
    if mode == "0":
        return None, "disabled by MOE_EP_CPU_FUSED=0"
    cc = _compiler()
    if cc is None:
        return None, _no_compiler_reason()
    try:
        root = cache_trust.cache_dir(
            "MOE_EP_CPU_FUSED_CACHE", env.cpu_fused_cache_dir(), "cpu_fused"
        )
        return _cached_or_built(cc, root), "built and loaded"
    except MoeEpUnavailableError as exc:
        return None, str(exc)
    except (OSError, RuntimeError) as exc:
        return None, f"building {SOURCE.name} failed: {exc}"


def status() -> tuple[bool, str]:
    """(whether the fused CPU epilogues are in use, why / why not); builds on first call."""
    lib, why = _load()
    return lib is not None, why


_warned = threading.Event()


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (eager fallback).

    Raises:
        MoeEpUnavailableError: MOE_EP_CPU_FUSED=1 and the library cannot be built.
    """
    lib, why = _load()
    if lib is not None:
        return lib
    mode = env.cpu_fused_mode()  # read only on the fallback path: library() runs per block
    if mode == "1":
        raise MoeEpUnavailableError(
            f"MOE_EP_CPU_FUSED=1 but the fused CPU epilogues cannot be built: {why} (or set "
            "MOE_EP_CPU_FUSED=auto to fall back to the eager code)"
        )
    if mode == "auto" and not _warned.is_set():
        _warned.set()
        warnings.warn(f"moe-ep: eager CPU epilogues (slower): {why}", stacklevel=2)
    return None


def parallel_workers(device: torch.device) -> int:
    """How many threads `run_single_threaded` spreads work over: torch's intra-op thread
    count on CPU when the library has OpenMP and torch's parallel backend is OpenMP (the
    same libgomp), else 1."""
    n = torch.get_num_threads()
    if device.type != "cpu" or n < 2:
        return 1
    lib = library()
    if lib is None or lib.moe_ep_omp_max_threads() < 1 or not _torch_uses_openmp():
        return 1
    return n


@functools.cache
def _torch_uses_openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def _single_threaded_worker() -> None:
    torch.get_num_threads()  # torch's per-thread OpenMP init first, or it would undo ours
    lib = library()
    if lib is not None:
        lib.moe_ep_omp_set_threads(1)


@functools.cache
def _workers(n: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(
        max_workers=n, thread_name_prefix="moe-ep-cpu", initializer=_single_threaded_worker
    )


def run_single_threaded(tasks: list[Callable[[], None]]) -> None:
    """Run `tasks` at once, each on its own thread with one OpenMP thread (torch ops and the
    fused kernels inside run serially): the first on the calling thread, the rest on a
    persistent pool. Waits for all; re-raises the first failure.

    For independent pieces of work that each run as well on one core (per-expert GEMMs of
    ~1000 rows: two at once on two threads beat each on two threads in turn)."""
    lib = library()
    if lib is None:
        for task in tasks:
            task()
        return
    futures = [_workers(len(tasks) - 1).submit(task) for task in tasks[1:]] if tasks[1:] else []
    before = lib.moe_ep_omp_max_threads()
    lib.moe_ep_omp_set_threads(1)
    try:
        tasks[0]()
    finally:
        lib.moe_ep_omp_set_threads(before)
        errors = [f.exception() for f in futures]
    for err in errors:
        if err is not None:
            raise err


def _threads(rows: int) -> int:
    """torch's intra-op thread count, fewer for small calls."""
    return max(1, min(torch.get_num_threads(), rows // _MIN_ROWS_PER_THREAD))


def _rows_ok(*tensors: torch.Tensor) -> bool:
    return all(
        t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.dim() == 2 and t.stride(1) == 1
        for t in tensors
    )


def swiglu(gu: torch.Tensor, h: torch.Tensor, alpha: float | None, clamp: float | None) -> bool:
    """`h [b, I] = bf16(silu(g) * u)` for `gu [b, 2I] = [g | u]` (both bf16, CPU).

    Returns False (nothing written) when the fused path does not apply; the caller then
    runs the eager code. Raises ValueError where the shapes do not pair up (the C loop
    would read `u` at the wrong column, or past the rows).
    """
    if gu.dim() != 2 or h.dim() != 2 or gu.shape != (h.shape[0], 2 * h.shape[1]):
        raise ValueError(
            f"swiglu gu must be [rows, 2 * I] for h [rows, I], got gu {tuple(gu.shape)} "
            f"and h {tuple(h.shape)}"
        )
    lib = library() if _rows_ok(gu, h) else None
    if lib is None:
        return False
    rows = int(h.shape[0])
    lib.moe_ep_swiglu_bf16(
        gu.data_ptr(), gu.stride(0), h.data_ptr(), h.stride(0), rows, int(h.shape[1]),
        alpha is not None, alpha or 1.0, clamp is not None, clamp or 0.0, _threads(rows),
    )  # fmt: skip
    return True


def combine(y: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """`out[t] = bf16(sum_j w[t, j] * y[pos[t, j]])`, fp32 terms added in slot order.

    y `[P, H]` and out `[n, H]` bf16 on CPU; pos `[n, k]` int64 (rows of y, or -1 for a
    padded slot: a +0 term, no row read), w `[n, k]` fp32. Returns False (nothing written)
    when the fused path does not apply.
    """
    lib = library() if _rows_ok(y, out) else None
    if lib is None:
        return False
    pos, w = pos.contiguous(), w.to(torch.float32).contiguous()
    n, k = int(pos.shape[0]), int(pos.shape[1])
    lib.moe_ep_combine_bf16(
        y.data_ptr(), y.stride(0), pos.data_ptr(), w.data_ptr(), out.data_ptr(), out.stride(0),
        n, k, int(y.shape[1]), _threads(n),
    )  # fmt: skip
    return True


Code = Literal["bf16", "e4m3", "e2m1"]
Scale = Literal["fp32", "e8m0", "e4m3"]
_CODE_KIND = {"bf16": 0, "e4m3": 1, "e2m1": 2}
_PACKED_KIND = {"bf16": 3, "e4m3": 4}
"""cpu_fused.c's EG_W_BF16_K16 / EG_W_E4M3_K16: `PackedK16` weights by code."""
_SCALE_KIND = {None: 0, "fp32": 1, "e8m0": 2, "e4m3": 3}
_CODE_DTYPE = {"bf16": torch.bfloat16, "e4m3": torch.uint8, "e2m1": torch.uint8}
_SCALE_DTYPE = {"fp32": torch.float32, "e8m0": torch.uint8, "e4m3": torch.uint8}


FAKE_QUANT_KINDS = {"nvfp4": 0, "mxfp8": 1, "fp8": 2, "fp8_ue8m0": 3, "fp8_hybrid": 4}
"""The requantizations `fake_quant` does, by name (the C library's FQ_* codes)."""


class FakeQuant(NamedTuple):
    """A recipe's FC2-input requantization as `fake_quant` does it: `kind` (a key of
    `FAKE_QUANT_KINDS`), `block` elements per scale, nvfp4's `norm_const` (1.0: none)."""

    kind: str
    block: int
    norm_const: float = 1.0


def fake_quant(x: torch.Tensor, out: torch.Tensor, spec: FakeQuant) -> bool:
    """`out = requantize(x)`: each block of `spec.block` elements of `x [rows, n]` (fp32, CPU)
    quantized and dequantized in one pass, rounded to out's dtype (bf16 or fp32). `out`
    may be `x` itself (each block is read whole before its values are written).

    The same fp32 operations in the same order as moe_ep.quant's quantize / dequantize pair
    the recipe names (`Recipe.requantize`): the same bits, NaN where that gives NaN (its
    payload may differ). Returns False (nothing written) when the fused path does not apply
    (no library, other dtypes or devices, a row stride other than 1, n not a multiple of the
    block, a norm_const not positive and finite); the caller then runs the eager code.
    """
    kind = FAKE_QUANT_KINDS[spec.kind]
    rows, n = (int(d) for d in x.shape) if x.dim() == 2 else (0, 0)
    ok = (
        x.dim() == 2
        and out.shape == x.shape
        and x.dtype == torch.float32
        and out.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and out.device.type == "cpu"
        and x.stride(1) == 1
        and out.stride(1) == 1
        and spec.block > 0
        and n % spec.block == 0
        and 0.0 < spec.norm_const < float("inf")
    )
    lib = library() if ok else None
    if lib is None or not hasattr(lib, "moe_ep_fake_quant"):  # an older baseline library
        return False
    lib.moe_ep_fake_quant(
        x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), out.dtype == torch.bfloat16,
        rows, n, kind, spec.block, spec.norm_const, _threads(rows),
    )  # fmt: skip
    return True


E4M3_CODE_KINDS = ("fp8", "fp8_ue8m0", "fp8_hybrid")
"""The `fake_quant` kinds whose scale is one fp32 value per block (`quant_e4m3`)."""


def quant_e4m3(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, spec: FakeQuant) -> bool:
    """`codes [rows, n]` (uint8 e4m3fn bytes) and `scales [rows, n / block]` (fp32) of
    `x [rows, n]` (fp32, CPU) quantized as `fake_quant(x, out, spec)` quantizes it (`out` is
    `code * scale`): the codes and scales the recipe's eager quantizer gives for finite
    blocks (`moe_ep.quant.quantize_fp8_blockwise`, fp32 or ue8m0 scales;
    `quantize_fp8_fc2_hybrid`), a block with NaN or inf scale NaN. `spec.kind` one of
    `E4M3_CODE_KINDS`. Each tensor's last dim contiguous (rows may be strided: a payload's
    views). Returns False (nothing written) where the fused path does not apply (no library
    or an older one, other dtypes, shapes or devices)."""
    rows, n = (int(d) for d in x.shape) if x.dim() == 2 else (0, 0)
    block = spec.block
    ok = (
        spec.kind in E4M3_CODE_KINDS
        and x.dim() == 2
        and x.dtype == torch.float32
        and codes.dtype in (torch.uint8, torch.float8_e4m3fn)
        and scales.dtype == torch.float32
        and block > 0
        and n % block == 0
        and tuple(codes.shape) == (rows, n)
        and tuple(scales.shape) == (rows, n // block)
        and all(t.device.type == "cpu" and t.stride(1) == 1 for t in (x, codes, scales))
    )
    lib = library() if ok else None
    if lib is None or not hasattr(lib, "moe_ep_quant_e4m3"):
        return False
    rc = lib.moe_ep_quant_e4m3(
        x.data_ptr(), x.stride(0), codes.data_ptr(), codes.stride(0), scales.data_ptr(),
        scales.stride(0), rows, n, FAKE_QUANT_KINDS[spec.kind], block, _threads(rows),
    )  # fmt: skip
    return bool(rc == 0)


@dataclass(frozen=True)
class E4m3Rows:
    """Activation rows as e4m3 codes and their fp32 block scales, the operand form of
    `expert_gemm`'s block-scaled order: `codes [R, K]` uint8 (e4m3fn bytes), `scales [R, K
    / block]` fp32, row r's value `code * scale` (each tensor's rows may be strided, e.g.
    views of a dispatch payload)."""

    codes: torch.Tensor
    scales: torch.Tensor
    block: int


@dataclass(frozen=True)
class StoredWeight:
    """One expert weight as `expert_gemm` reads it: `[E_local, N, K]` in its stored width.

    codes: `[E_local, N, K]` bf16 or uint8 e4m3fn bytes, or `[E_local, N, K/2]` uint8 e2m1
        codes two per byte (element 2i in the low nibble); each row contiguous.
    scales: None, or `[E_local, N, K/block]` per-row block scales: fp32, or uint8 bytes of
        E8M0 / e4m3fn; the dequantized weight is `code * scale`, one fp32 product (the
        recipes' `moe_ep.quant` dequantize).
    """

    codes: torch.Tensor
    code: Code
    scales: torch.Tensor | None = None
    scale: Scale | None = None
    block: int = 0

    def __post_init__(self) -> None:
        c, s = self.codes, self.scales
        if c.dim() != 3 or c.dtype != _CODE_DTYPE[self.code] or c.stride(2) != 1:
            raise ValueError(f"StoredWeight codes must be [E, N, K] {self.code} rows, got {c}")
        if (s is None) != (self.scale is None):
            raise ValueError("StoredWeight needs scales and their kind together")
        if s is not None and self.scale is not None:
            nb = self.k // self.block if self.block % 16 == 0 and self.block else -1
            if s.dtype != _SCALE_DTYPE[self.scale] or tuple(s.shape) != (*c.shape[:2], nb):
                raise ValueError(
                    f"StoredWeight scales must be {self.scale} [E, N, K/{self.block}] "
                    f"(block a multiple of 16), got {s.dtype} {tuple(s.shape)}"
                )
            if s.stride(2) != 1:
                raise ValueError("StoredWeight scale rows must be contiguous")

    @property
    def k(self) -> int:
        """Elements per row (K)."""
        return int(self.codes.shape[2]) * (2 if self.code == "e2m1" else 1)

    @property
    def n(self) -> int:
        """Rows per expert (N: output columns of the GEMM)."""
        return int(self.codes.shape[1])

    def nbytes(self, experts: int = 1) -> int:
        """Bytes `expert_gemm` reads for `experts` experts (codes and scales)."""
        per = self.codes[0].numel() * self.codes.element_size()
        if self.scales is not None:
            per += self.scales[0].numel() * self.scales.element_size()
        return experts * per


PACK_COLS = 16
"""Output columns per block of `PackedK16` (cpu_fused.c's EG_PCOLS)."""

PACKED_SCALE_LIMIT = 256.0
"""`pack_k16_codes` takes scales of magnitude below this (cpu_fused.c's short e4m3 decode
folds 2^120 into the scale, which must stay finite)."""


@dataclass(frozen=True)
class PackedK16:
    """Expert weights packed for the k order (`pack_k16`, `pack_k16_codes`): `codes [E,
    ceil(N/16), K, 16]`, per expert blocks of 16 output columns, per block its K elements in
    increasing k, each the 16 columns' values (column 16b + j at `[e, b, :, j]`; a last
    block's missing columns zero): bf16 values, or uint8 e4m3fn codes (NaN-free) with
    `scales [E, ceil(N/16), K/block, 16]` fp32 (|s| < `PACKED_SCALE_LIMIT`), the weight
    being `code * scale`, one fp32 product (the recipes' dequantize). `expert_gemm` reads it
    with the k-order bodies only (`vector=True`: the AVX2 one where the CPU has AVX2, else
    its scalar twin; "avx2kseq", "kseq_scalar"): for bf16 values the bits of those bodies on
    the unpacked weights, at every row count, for bf16 x; fp32 x too, in the same chain of
    fma's, and codes in that chain on their dequantized values (cpu_fused.c)."""

    codes: torch.Tensor
    n: int
    scales: torch.Tensor | None = None
    block: int = 0

    def __post_init__(self) -> None:
        c, s = self.codes, self.scales
        blocks = -(-self.n // PACK_COLS)
        if (
            c.dim() != 4
            or c.dtype not in (torch.bfloat16, torch.uint8)
            or not c.is_contiguous()
            or (int(c.shape[1]), int(c.shape[3])) != (blocks, PACK_COLS)
        ):
            raise ValueError(
                f"PackedK16 codes must be contiguous bf16 / uint8 [E, {blocks}, K, {PACK_COLS}] "
                f"for n={self.n}, got {c.dtype} {tuple(c.shape)}"
            )
        if (s is None) != (c.dtype == torch.bfloat16):
            raise ValueError("PackedK16 takes scales with uint8 e4m3 codes and with them only")
        if s is not None:
            nb = self.k // self.block if self.block > 0 and self.block % 16 == 0 else -1
            want = (*c.shape[:2], nb, PACK_COLS)
            if s.dtype != torch.float32 or not s.is_contiguous() or tuple(s.shape) != want:
                raise ValueError(
                    f"PackedK16 scales must be contiguous fp32 {list(want)} (block "
                    f"{self.block}, a multiple of 16 dividing K), got {s.dtype} {tuple(s.shape)}"
                )

    @property
    def code(self) -> Code:
        """ "bf16" (values) or "e4m3" (codes with `scales`)."""
        return "bf16" if self.codes.dtype == torch.bfloat16 else "e4m3"

    @property
    def scale(self) -> Scale | None:
        """The scales' kind: "fp32", or None for bf16 values."""
        return None if self.scales is None else "fp32"

    @property
    def k(self) -> int:
        """Elements per output column (K)."""
        return int(self.codes.shape[2])

    def nbytes(self, experts: int = 1) -> int:
        """Bytes `expert_gemm` reads for `experts` experts (codes and scales)."""
        per = self.codes[0].numel() * self.codes.element_size()
        if self.scales is not None:
            per += self.scales[0].numel() * 4
        return experts * per

    def unpacked(self) -> torch.Tensor:
        """The bf16 values as `[E, N, K]` (a copy, the weights `pack_k16` packed, bit for
        bit); ValueError for codes."""
        if self.scales is not None:
            raise ValueError("PackedK16.unpacked: the weights are e4m3 codes, not bf16 values")
        e, blocks, k, _ = (int(d) for d in self.codes.shape)
        whole = self.codes.transpose(2, 3).reshape(e, blocks * PACK_COLS, k)
        return whole[:, : self.n].contiguous()

    def widen(self, e: int, j: int, m: int, dst: torch.Tensor) -> None:
        """`dst[:m] = W[j : j + m]` in fp32 (`dst` K-contiguous rows, room for whole blocks):
        expert e's columns j to j + m (j a multiple of 16) as their values: bf16 widened
        (exact), or codes times their scales, one fp32 product each (the products
        `expert_gemm` and the recipes' dequantize form)."""
        c, b0, k = -(-m // PACK_COLS), j // PACK_COLS, self.k
        if self.scales is None:
            dst[: c * PACK_COLS].view(c, PACK_COLS, k).copy_(
                self.codes[e, b0 : b0 + c].transpose(1, 2)
            )
            return
        lib = library()
        assert lib is not None and dst.stride(1) == 1  # codes pack with the library only
        codes, scales = self.codes[e, b0], self.scales[e, b0]
        lib.moe_ep_widen_k16(
            codes.data_ptr(), self.codes.stride(1), scales.data_ptr(), self.scales.stride(1),
            self.block, m, k, dst.data_ptr(), dst.stride(0), max(1, torch.get_num_threads()),
        )  # fmt: skip


def _to_blocks(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`w [E, N, M]` -> `[E, ceil(N/16), M, 16]` of `dtype`, zeros past N, one expert at a
    time (the temporaries are one expert's)."""
    e, n, m = (int(d) for d in w.shape)
    whole = n // PACK_COLS
    out = torch.zeros(e, -(-n // PACK_COLS), m, PACK_COLS, dtype=dtype)
    for i in range(e):
        src = w[i] if w.dtype == dtype else w[i].to(dtype)
        out[i, :whole].copy_(src[: whole * PACK_COLS].view(whole, PACK_COLS, m).transpose(1, 2))
        if n % PACK_COLS:
            out[i, whole, :, : n % PACK_COLS].copy_(src[whole * PACK_COLS :].t())
    return out


def pack_k16(w: torch.Tensor) -> PackedK16:
    """A bf16 copy of the weights `w [E, N, K]` (bf16, or fp32 whose values are exact in
    bf16: a quantized format's dequantized weights) in `PackedK16`'s layout. ValueError where
    an fp32 value is not exact in bf16 (nothing is rounded silently)."""
    if w.dim() != 3 or w.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"pack_k16 packs bf16 / fp32 [E, N, K] weights, got {w.dtype} {w.shape}")
    if w.dtype != torch.bfloat16:
        for i in range(int(w.shape[0])):
            inexact = (w[i].to(torch.bfloat16).float() != w[i]) & ~w[i].isnan()
            if bool(inexact.any()):
                at = [int(v) for v in inexact.nonzero()[0]]
                raise ValueError(
                    f"pack_k16: weight [{i}, {at[0]}, {at[1]}] = {float(w[i, at[0], at[1]])!r} "
                    "is not exact in bf16 (the packed copy would round it)"
                )
    return PackedK16(_to_blocks(w, torch.bfloat16), int(w.shape[1]))


def codes_unpackable(w: StoredWeight) -> str | None:
    """Why `pack_k16_codes` refuses `w`, or None where it packs it."""
    lib = library()
    if lib is None or not hasattr(lib, "moe_ep_widen_k16"):
        return "the fused CPU library is not loaded or predates packed codes"
    if w.code != "e4m3" or w.scale not in ("fp32", "e8m0") or w.scales is None:
        return f"the weights are {w.code} codes with {w.scale} scales (e4m3 with fp32 / e8m0 packs)"
    if w.block % PACK_COLS or w.k % w.block:
        return f"the scale block {w.block} is not a multiple of {PACK_COLS} dividing K={w.k}"
    if any(bool(((c & 0x7F) == 0x7F).any()) for c in w.codes):  # an expert's temporaries
        return "the weights hold e4m3 NaN codes"
    s = _fp32_scales(w)
    if not bool((s.abs() < PACKED_SCALE_LIMIT).all()):
        return f"a weight scale is not finite or not below {PACKED_SCALE_LIMIT:g} in magnitude"
    return None


def _fp32_scales(w: StoredWeight) -> torch.Tensor:
    assert w.scales is not None
    return w.scales if w.scale == "fp32" else e8m0_to_float32(w.scales)


def pack_k16_codes(w: StoredWeight) -> PackedK16:
    """The e4m3 codes of `w` and their scales (fp32, or e8m0 as fp32) in `PackedK16`'s
    layout: 1 byte a weight plus 4 per 16 columns and scale block. ValueError where
    `codes_unpackable` says why not."""
    why = codes_unpackable(w)
    if why is not None:
        raise ValueError(f"pack_k16_codes: {why}")
    s = _fp32_scales(w)
    return PackedK16(_to_blocks(w.codes, torch.uint8), w.n, _to_blocks(s, torch.float32), w.block)


def exact_in_bf16(w: StoredWeight | PackedK16) -> bool:
    """Whether every value of `w` (code times scale) is exact in bf16: bf16, or codes and
    scales the AMX order takes (e4m3 with e8m0 or none, e2m1 with e8m0 / e4m3 or none)."""
    return (w.code, w.scale) in _AMX_WEIGHTS


@dataclass(frozen=True)
class ExpertGroups:
    """The row groups of one `expert_gemm` call, as int64 tensors on the CPU.

    q_start: `[G + 1]` group g owns the call's rows `[q_start[g], q_start[g + 1])`.
    expert: `[G]` the local expert of each group.
    out_row0: `[G]` the output row of each group's first row (its rows follow in order).
    path_rows: `[G]` the row count that picks each group's vector body where that changes
        the sum order (the k order from `KSEQ_ROWS` rows, the dot body from 3): a replica's
        logical expert's rows, so that every copy sums as the whole would; None: its own.
    """

    q_start: torch.Tensor
    expert: torch.Tensor
    out_row0: torch.Tensor
    path_rows: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return int(self.q_start[-1])


Body = Literal[
    "avx512", "avx2", "avx512bf16", "bf16dot_scalar", "avx2kseq", "kseq_scalar", "amx",
    "amx_scalar",
]  # fmt: skip
_BODY_KIND: dict[Body, int] = {
    "avx2": 1, "avx512": 2, "avx512bf16": 4, "bf16dot_scalar": 5, "avx2kseq": 6, "kseq_scalar": 7,
    "amx": 8, "amx_scalar": 9,
}  # fmt: skip
_BODY_BIT: dict[Body, int] = {
    "avx2": 1, "avx512": 4, "avx512bf16": 8, "bf16dot_scalar": 0, "avx2kseq": 1, "kseq_scalar": 0,
    "amx": 16, "amx_scalar": 0,
}  # fmt: skip
_BF16_ONLY_BODIES = ("avx512bf16", "bf16dot_scalar", "avx2kseq", "kseq_scalar")
"""The bodies of the bf16 dot-product order and of the k order (bf16 x and weights only;
cpu_fused.c)."""
_AMX_BODIES = ("amx", "amx_scalar")
_AMX_WEIGHTS = {
    ("bf16", None), ("e4m3", None), ("e4m3", "e8m0"), ("e2m1", None), ("e2m1", "e8m0"),
    ("e2m1", "e4m3"),
}  # fmt: skip
"""The AMX order's weights (code, scale): those whose values are exact in bf16."""


def vector_bodies() -> int:
    """Bit 0: the library has the AVX2 expert GEMM body; bit 1: the AVX-512 epilogues; bit
    2: the AVX-512F expert GEMM body and this CPU runs it; bit 3: the AVX-512 BF16 one
    (`vdpbf16ps`) and this CPU runs it; bit 4: the AMX one (`tdpbf16ps`), this CPU has
    AMX-BF16 and AVX512-VBMI (its code decode) and Linux granted the process the tile
    state. 0 without the library."""
    lib = library()
    return 0 if lib is None else int(lib.moe_ep_vector_bodies())


def runnable_bodies() -> list[Body]:
    """The vector bodies (`expert_gemm`'s `vector` names) this build and CPU run, from
    `vector_bodies()`; the scalar twins, which run anywhere, are not listed."""
    bodies = vector_bodies()
    return [name for name, bit in _BODY_BIT.items() if bit and bodies & bit]


_BODY_AUTO = 3
"""cpu_fused.c's EG_BODY_AUTO: for bf16 x and weights AMX where the CPU has it (every
group), else AVX-512 BF16 where it has that, with AVX2 for experts of 1-2 path rows
(faster); else AVX-512F, with AVX2 for bf16 blocks of 1-2 rows (faster); without AVX-512F
the AVX2 body, with the k order (AVX2) for bf16 experts of `KSEQ_ROWS` rows or more."""
KSEQ_ROWS = 13
"""cpu_fused.c's EG_KSEQ_ROWS (kept equal by a test)."""


def kseq_by_default() -> bool:
    """Whether `expert_gemm(vector=True)` takes the AVX2 k order for bf16 groups of
    `KSEQ_ROWS`+ path rows here: the AVX2 body and no AVX-512F one (cpu_fused.c's
    auto_kseq)."""
    bodies = vector_bodies()
    return bool(bodies & _BODY_BIT["avx2"]) and not bodies & _BODY_BIT["avx512"]


def block_scaled_by_default() -> bool:
    """Whether the block-scaled AMX order (`expert_gemm` with `x_scales`) and the e4m3
    codes pass (`quant_e4m3`) run here: the AMX body and a library that has both."""
    lib = library()
    return (
        amx_by_default()
        and hasattr(lib, "moe_ep_expert_gemm_v3")
        and hasattr(lib, "moe_ep_quant_e4m3")
    )


def amx_by_default() -> bool:
    """Whether `expert_gemm(vector=True)` takes the AMX body for bf16 groups here: the CPU
    has AMX-BF16 (and AVX512-VBMI) and the library the AMX body (cpu_fused.c's auto_amx)."""
    return bool(vector_bodies() & _BODY_BIT["amx"])


def _body_kind(vector: bool | Body) -> int:
    """`expert_gemm`'s `vector` as the C body number: True the fastest this CPU runs."""
    if vector is False:
        return 0
    bodies = vector_bodies()
    if vector is True:
        return _BODY_AUTO if bodies & (_BODY_BIT["avx512"] | _BODY_BIT["avx2"]) else 0
    if vector not in _BODY_KIND:
        raise ValueError(
            f"expert_gemm vector must be True, False or one of {', '.join(_BODY_KIND)}, "
            f"got {vector!r}"
        )
    if _BODY_BIT[vector] and not bodies & _BODY_BIT[vector]:
        raise ValueError(
            f"expert_gemm vector={vector!r}: this build or CPU lacks that body "
            f"(moe_ep_vector_bodies() = {bodies:#x})"
        )
    return _BODY_KIND[vector]


_X_KIND = {torch.bfloat16: 0, torch.float32: 1, torch.uint8: 2}
"""cpu_fused.c's EG_X_*: bf16, fp32 values, e4m3 codes (the block-scaled AMX order)."""


def block_scaled_weights(w: StoredWeight) -> bool:
    """Whether `expert_gemm`'s block-scaled order takes these weights: e4m3 codes with fp32
    scales, or weights exact in bf16 (the AMX order's)."""
    return (w.code, w.scale) == ("e4m3", "fp32") or exact_in_bf16(w)


def _check_block_scaled(
    x: torch.Tensor, x_scales: torch.Tensor, x_block: int, w: StoredWeight, vector: bool | Body
) -> None:
    """ValueError unless `expert_gemm`'s block-scaled order applies to these operands."""
    k = w.k
    if x.dtype not in (torch.uint8, torch.float8_e4m3fn) or x.dim() != 2 or int(x.shape[1]) != k:
        raise ValueError(
            f"expert_gemm with x_scales needs x as [R, {k}] e4m3 codes (uint8 / "
            f"float8_e4m3fn), got {x.dtype} {tuple(x.shape)}"
        )
    if vector not in _AMX_BODIES:
        raise ValueError(
            f"expert_gemm with x_scales sums in the block-scaled AMX order: vector must be one "
            f"of {', '.join(_AMX_BODIES)}, got {vector!r}"
        )
    both = (w.code, w.scale) == ("e4m3", "fp32")
    if not block_scaled_weights(w):
        raise ValueError(
            f"expert_gemm with x_scales needs e4m3 weights with fp32 scales or weights exact "
            f"in bf16, got {w.code} with {w.scale} scales"
        )
    blocks = (x_block, w.block) if both else (x_block,)
    if any(b <= 0 or b % 32 or k % b for b in blocks) or (
        both and x_block % w.block and w.block % x_block
    ):
        raise ValueError(
            f"expert_gemm x_block={x_block} (and fp32-scaled weights' block {w.block}) must "
            f"be multiples of 32 dividing K={k}, one dividing the other"
        )
    expect = (int(x.shape[0]), k // x_block)
    shape = tuple(x_scales.shape)
    if x_scales.dtype != torch.float32 or shape != expect or x_scales.stride(1) != 1:
        raise ValueError(
            f"expert_gemm x_scales must be fp32 {list(expect)} contiguous along the last dim, "
            f"got {x_scales.dtype} {tuple(x_scales.shape)} strides {x_scales.stride()}"
        )


def expert_gemm_scratch(rows: int, k: int) -> tuple[int]:
    """Shape of the fp32 scratch `expert_gemm` needs for `rows` rows of `k` elements."""
    return (rows * (-(-k // 16) * 16 + 16),)  # rows a cache line longer (cpu_fused.c)


def expert_gemm(
    x: torch.Tensor,
    x_rows: torch.Tensor | None,
    groups: ExpertGroups,
    w: StoredWeight | PackedK16,
    out: torch.Tensor,
    scratch: torch.Tensor,
    *,
    alpha: torch.Tensor | None = None,
    vector: bool | Body = True,
    x_scales: torch.Tensor | None = None,
    x_block: int = 0,
) -> bool:
    """`out[out_row0[g] + i] = x[row(q_start[g] + i)] @ w[expert[g]]^T` (times `alpha[g]`).

    x: `[R, K]` bf16 or fp32 CPU rows (contiguous along K); `x_rows`: `[Q]` int64 rows of x
    (None: row q is x's row q). out: `[*, N]` bf16 or fp32 rows. alpha: `[G]` fp32 or None.
    scratch: fp32 with at least `expert_gemm_scratch(Q, K)` elements. The sum order is fixed
    (cpu_fused.c): the result does not depend on the thread count, the vector body or the
    grouping. `vector`: True the fastest vector bodies this CPU runs (bf16 x and weights:
    AMX where the CPU has it, else AVX-512 BF16 where it has that with AVX2 for groups of
    1-2 path rows; else AVX-512F, with AVX2 for bf16 row blocks of 1-2 rows; else
    AVX2, with the AVX2 k order for bf16 groups of `KSEQ_ROWS`+ path rows; else the scalar
    twin), False the scalar twin, "avx512" / "avx2" that body alone (ValueError where it is
    missing): tests force each. "avx512bf16" (ValueError where missing) and its twin
    "bf16dot_scalar" (anywhere) sum in the bf16 dot-product order instead, "amx" (ValueError
    where missing) and its twin "amx_scalar" (anywhere) in the AMX order, "avx2kseq"
    (ValueError where missing) and its twin "kseq_scalar" (anywhere) in the k order (each
    output one fp32 fma chain in increasing k): other orders, other bits (cpu_fused.c), bf16
    x and weights only, but for "amx" / "amx_scalar": fp32 x too (every value exact in bf16,
    else ValueError with nothing written) and codes whose values are exact in bf16 (e4m3
    with e8m0 scales, e2m1 with e8m0 / e4m3 scales; fp32-scaled fp8 refused). `w` a
    `PackedK16` (bf16 or fp32 x): the k order at every row count, `vector` True (the AVX2
    body where the CPU has AVX2, else the twin), "avx2kseq" or "kseq_scalar" (others
    refused).

    x_scales: the block-scaled AMX order (fp8's `x @ w^T` from both operands' codes): x holds
    e4m3 codes (uint8 or float8_e4m3fn), `x_scales [R, K / x_block]` fp32 their scales (rows
    as x's, contiguous along the last dim), `vector` "amx" or "amx_scalar"; w e4m3 codes
    with fp32 scales (x_block and w's block multiples of 32, one dividing the other: each
    sum block, the smaller, of codes summed in the AMX order from +0, then `acc = fma(sum,
    fp32(x scale * w scale), acc)` over the blocks in increasing K from +0), or weights the
    AMX order takes (exact in bf16: each x block of x's code values times the weights'
    values summed so, then `acc = fma(sum, x scale, acc)`; the sm90 hybrids) (cpu_fused.c).
    Returns False (nothing written) when the library is not available (or, with x_scales,
    predates that order).
    """
    lib = library()
    if lib is None or (x_scales is not None and not hasattr(lib, "moe_ep_expert_gemm_v3")):
        return False
    packed = isinstance(w, PackedK16)
    if packed and (vector not in (True, "avx2kseq", "kseq_scalar") or x_scales is not None):
        raise ValueError(
            f"expert_gemm reads PackedK16 weights with the k-order bodies only (vector True, "
            f"'avx2kseq' or 'kseq_scalar', no x_scales), got vector={vector!r}"
        )
    k, n = w.k, w.n
    q = groups.rows
    if x_scales is not None:
        assert isinstance(w, StoredWeight)  # packed weights refused above
        _check_block_scaled(x, x_scales, x_block, w, vector)
        x = x.view(torch.uint8)
    elif x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2 or int(x.shape[1]) != k:
        raise ValueError(f"expert_gemm x must be [R, {k}] bf16 / fp32, got {x.dtype} {x.shape}")
    if out.dtype not in (torch.bfloat16, torch.float32) or int(out.shape[1]) != n:
        raise ValueError(f"expert_gemm out must be [*, {n}] bf16 / fp32, got {out.shape}")
    if x.stride(1) != 1 or out.stride(1) != 1 or not scratch.is_contiguous():
        raise ValueError("expert_gemm needs rows contiguous along the last dim")
    if scratch.dtype != torch.float32 or scratch.numel() < expert_gemm_scratch(q, k)[0]:
        raise ValueError("expert_gemm scratch too small")
    for t in (groups.q_start, groups.expert, groups.out_row0, groups.path_rows, x_rows):
        if t is not None and (t.dtype != torch.int64 or not t.is_contiguous()):
            raise ValueError("expert_gemm row and group indices must be contiguous int64")
    if alpha is not None and (alpha.dtype != torch.float32 or not alpha.is_contiguous()):
        raise ValueError("expert_gemm alpha must be contiguous fp32")
    body = _BODY_AUTO if packed and vector is True else _body_kind(vector)
    if (
        vector in _BF16_ONLY_BODIES
        and not packed
        and (x.dtype != torch.bfloat16 or w.code != "bf16")
    ):
        raise ValueError(
            f"expert_gemm vector={vector!r} needs bf16 x and bf16 weights, got x {x.dtype} "
            f"and weights {w.code}"
        )
    if vector in _AMX_BODIES and not exact_in_bf16(w) and x_scales is None:
        raise ValueError(
            f"expert_gemm vector={vector!r} needs weights exact in bf16 (bf16, e4m3 with e8m0 "
            f"or no scales, e2m1 with e8m0 / e4m3 or no scales), got {w.code} with {w.scale} "
            "scales"
        )
    s = w.scales
    path = groups.path_rows
    x_args = (
        x.data_ptr(), x.stride(0), _X_KIND[x.dtype], None if x_rows is None else x_rows.data_ptr(),
    )  # fmt: skip
    if x_scales is not None:
        fn = functools.partial(
            lib.moe_ep_expert_gemm_v3, *x_args, x_scales.data_ptr(), x_scales.stride(0), x_block
        )
    else:
        fn = functools.partial(lib.moe_ep_expert_gemm_v2, *x_args)
    rc = fn(
        int(groups.expert.numel()), groups.q_start.data_ptr(), groups.expert.data_ptr(),
        groups.out_row0.data_ptr(), None if path is None else path.data_ptr(),
        None if alpha is None else alpha.data_ptr(),
        w.codes.data_ptr(), w.codes.stride(0) * w.codes.element_size(),
        w.codes.stride(1) * w.codes.element_size(),
        (_PACKED_KIND if packed else _CODE_KIND)[w.code],
        None if s is None else s.data_ptr(),
        0 if s is None else s.stride(0) * s.element_size(),
        0 if s is None else s.stride(1) * s.element_size(),
        _SCALE_KIND[w.scale], max(w.block, 16),
        out.data_ptr(), out.stride(0), 1 if out.dtype == torch.float32 else 0,
        n, k, scratch.data_ptr(), max(1, torch.get_num_threads()), body,
    )  # fmt: skip
    if rc in (-2, -3):
        raise ValueError(f"expert_gemm: the library refused vector body {body} (rc {rc})")
    if rc == -4:
        raise ValueError(
            f"expert_gemm vector={vector!r}: x holds an fp32 value that is not exact in bf16 "
            "(the AMX order's operands must be; nothing written)"
        )
    if rc != 0:
        raise MemoryError("expert_gemm: out of memory for its work list")
    return True

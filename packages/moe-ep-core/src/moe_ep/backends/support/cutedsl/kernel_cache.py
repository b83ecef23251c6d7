"""Persistent cache of compiled CuTe DSL kernels, on `moe_ep.cache_trust`'s rules.

What nvidia-cutlass-dsl 4.8.1 can persist (docs/runtime.md, "Kernel cache", has the probe's
output): `cute.compile` turns the DSL's own file cache off (it warns "Cache is disabled as user
wants to compile only"), but its result's `dump_to_object(prefix)` gives an ELF object holding
the host launch entry and the cubin, and `cutlass.cute.runtime.load_module(path)[prefix]`
loads it in another process, without a GPU, as the same `JitCompiledFunction` type. That
object is what an entry holds (`kernel.o`, beside `key.json`, the key's components).

An entry is named by the sha256 of its key (`KernelKey`): the kernel's taxonomy name, its
drop's `tree_sha256` (the lock beside the drop class's source), the arch, the config's and
the geometry's fields, the cutlass-dsl / CUDA / torch versions and the sha256 of our own
sources that build the kernel and its arguments. An entry whose manifest does not verify,
whose `key.json` differs or whose object the DSL refuses is rebuilt and replaced, never run.

Used, when `MOE_EP_CUTEDSL_CACHE` is set, by the compile-only checks
(`compile_fakes.timed_compile`) and by the launch path (`pooled_kernel.compile_collective`),
with the same key; each rank has its own entry (the geometry's rank is in the key). A loaded
kernel has never been launched (no GPU).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from moe_ep import cache_trust, env

__all__ = [
    "CACHE_VAR",
    "KEY_FILE",
    "OBJECT_FILE",
    "KernelKey",
    "compile_cached",
    "drop_digest",
    "kernel_cache_root",
    "kernel_key",
    "launch_arch",
    "load_or_compile",
]

CACHE_VAR = "MOE_EP_CUTEDSL_CACHE"
OBJECT_FILE = "kernel.o"
KEY_FILE = "key.json"
_PREFIX = "moe_ep_kernel"  # the symbol prefix inside every object; one kernel per object
_LOCKS = ("vendor.lock.json", "_upstream.lock.json")  # a checkout's, a built wheel's
_VERSIONED = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "cuda-bindings", "torch")


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Everything that changes a compiled kernel; `name` is its entry's directory name."""

    kernel: str
    drop: str
    arch: str
    knobs: dict[str, Any]
    versions: dict[str, str]
    code: str

    def text(self) -> str:
        """The canonical JSON of the key (what `key.json` holds)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True, indent=1, default=repr)

    @property
    def name(self) -> str:
        digest = hashlib.sha256(self.text().encode()).hexdigest()[:32]
        return f"{self.kernel}-{self.arch}-{digest}"


def drop_digest(kernel: Any) -> str:
    """The `tree_sha256` of each drop `kernel`'s class and its bases come from (the nearest
    `vendor.lock.json` / `_upstream.lock.json` above each class's source file), joined by
    `+` in method resolution order: a kernel built over another drop's class (the sm90 NVFP4
    kernel over the MXFP4 one) changes with either drop.

    Raises:
        RuntimeError: no lock above any of the classes' files (not a drop kernel).
    """
    digests: list[str] = []
    for cls in type(kernel).__mro__:
        digest = _lock_digest(getattr(sys.modules.get(cls.__module__), "__file__", None))
        if digest is not None and digest not in digests:
            digests.append(digest)
    if not digests:
        source = getattr(sys.modules.get(type(kernel).__module__), "__file__", None)
        raise RuntimeError(f"{type(kernel).__qualname__} ({source}) is under no drop lock")
    return "+".join(digests)


def _lock_digest(file: str | None) -> str | None:
    """The `tree_sha256` of the nearest drop lock above `file`, None when there is none."""
    if not file:
        return None
    for d in Path(file).resolve().parents:
        for lock in _LOCKS:
            if (d / lock).is_file():
                return str(json.loads((d / lock).read_text(encoding="utf-8"))["tree_sha256"])
    return None


def _versions() -> dict[str, str]:
    found = {}
    for dist in _VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "absent"
    import torch

    found["torch.version.cuda"] = str(torch.version.cuda)
    return found


def _sources_digest(modules: Iterable[str]) -> str:
    """sha256 over the `.py` files of the packages holding `modules` (our wrapper code)."""
    h = hashlib.sha256()
    roots = sorted({Path(sys.modules[m].__file__ or "").resolve().parent for m in modules})
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def kernel_key(
    kernel: Any,
    *,
    config: Any,
    geometry: Any,
    arch: str,
    max_active_clusters: int | None = None,
) -> KernelKey:
    """The key of `kernel` (a drop kernel object) built from `config` (a `KernelConfig`
    dataclass) and `geometry` (a `LaunchGeometry`) for `arch`, with the cluster budget
    `max_active_clusters` (a compile-time constant that depends on the GPU's SM count)."""
    top = type(config).__module__.split(".")[0]  # the backend package that built it
    return KernelKey(
        kernel=config.kernel_name,
        drop=drop_digest(kernel),
        arch=arch,
        knobs={
            "config": dataclasses.asdict(config),
            "geometry": dataclasses.asdict(geometry),
            "max_active_clusters": max_active_clusters,
        },
        versions=_versions(),
        code=_sources_digest([top, __name__]),
    )


def kernel_cache_root() -> Path | None:
    """The cache directory `MOE_EP_CUTEDSL_CACHE` names (made private, see
    `moe_ep.cache_trust.private_dir`), None when it is unset (every compile runs).

    Raises:
        MoeEpUnavailableError: the directory is not private (`moe_ep.cache_trust`).
    """
    value = env.cutedsl_cache_dir()
    return None if value is None else cache_trust.cache_dir(CACHE_VAR, value, "cutedsl")


def launch_arch(device: Any) -> str:
    """The arch a launch compiles for: `CUTE_DSL_ARCH` when set (the DSL's own choice),
    else `sm_<major><minor>a` of `device`'s compute capability (`sm_90a`, `sm_100a`)."""
    chosen = env.cute_dsl_arch()
    if chosen:
        return chosen
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


def _load(entry: Path, key: KernelKey) -> Any | None:
    """The compiled kernel of a verified entry, None when its key differs or the DSL refuses
    its object (stale)."""
    import cutlass.cute as cute

    try:
        if (entry / KEY_FILE).read_text(encoding="utf-8") != key.text():
            return None
    except OSError:  # a verified entry without a key file: not one of ours
        return None
    try:
        return cute.runtime.load_module(str(entry / OBJECT_FILE))[_PREFIX]
    except Exception:  # the DSL's errors (DSLRuntimeError and what the engine raises)
        return None


def load_or_compile(key: KernelKey, compile: Callable[[], Any], root: Path) -> tuple[Any, bool]:
    """(compiled kernel, whether it came from the cache): the verified entry of `key` under
    `root` when there is one, else `compile()`, published as a new entry."""
    entry = cache_trust.find_entry(root, key.name)
    if entry is not None and (loaded := _load(entry, key)) is not None:
        return loaded, True
    compiled = compile()

    def build(out: Path) -> None:
        (out / OBJECT_FILE).write_bytes(compiled.dump_to_object(_PREFIX))
        (out / KEY_FILE).write_text(key.text(), encoding="utf-8")

    staged = cache_trust.stage(root, key.name, build)
    cache_trust.publish(staged, root / key.name, replace=entry is not None)
    return compiled, False


def compile_cached(
    kernel: Any,
    args: dict[str, Any],
    *,
    config: Any,
    geometry: Any,
    arch: str,
    root: Path | None = None,
) -> tuple[Any, bool, float]:
    """`cute.compile(kernel, **args, options="--gpu-arch <arch>")` through the cache under
    `root` (default: `kernel_cache_root()`; every compile runs when that is None);
    (compiled, whether it came from the cache, seconds). The key holds `args`'
    `max_active_clusters`, so the compile-only checks and the launch key alike."""
    import cutlass.cute as cute

    start = time.perf_counter()

    def compile() -> Any:
        return cute.compile(kernel, **args, options=f"--gpu-arch {arch}")

    if root is None:
        root = kernel_cache_root()
    if root is None:
        compiled, hit = compile(), False
    else:
        key = kernel_key(
            kernel,
            config=config,
            geometry=geometry,
            arch=arch,
            max_active_clusters=args.get("max_active_clusters"),
        )
        compiled, hit = load_or_compile(key, compile, root)
    return compiled, hit, time.perf_counter() - start

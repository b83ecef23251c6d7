"""A second build of the fused CPU library from another `cpu_fused.c` (an older commit's), to
time the layer with it beside the current one in the same round robin (same process, same
weights, same load): `layer_speed.py --baseline-kernel PATH`."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from moe_ep import cache_trust, env
from moe_ep.backends.portable import cpu_fused


def build(source: Path) -> ctypes.CDLL:
    """The library built from `source` (cached beside the current one, by its own digest).

    A source older than a function in `cpu_fused.NEWER_THAN_BASELINES` builds without it;
    the code runs the eager path on that library, as that commit did.

    Raises:
        RuntimeError: no C compiler, or `source` does not build into a library with every
            other function the current code binds.
    """
    cc = cpu_fused._compiler()
    if cc is None:
        raise RuntimeError(f"--baseline-kernel {source}: {cpu_fused._no_compiler_reason()}")
    root = cache_trust.cache_dir("MOE_EP_CPU_FUSED_CACHE", env.cpu_fused_cache_dir(), "cpu_fused")
    saved = cpu_fused.SOURCE
    cpu_fused.SOURCE = source
    try:
        return cpu_fused._cached_or_built(cc, root, cpu_fused.NEWER_THAN_BASELINES)
    finally:
        cpu_fused.SOURCE = saved


@contextmanager
def _using(lib: ctypes.CDLL) -> Iterator[None]:
    saved = cpu_fused._load
    cpu_fused._load = lambda: (lib, "baseline")  # type: ignore[assignment]
    try:
        yield
    finally:
        cpu_fused._load = saved


def with_library(lib: ctypes.CDLL, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` run with every `cpu_fused` call going to `lib` (the kernels look the library up
    per call, so a built layer switches with it)."""

    def run() -> object:
        with _using(lib):
            return fn()

    return run

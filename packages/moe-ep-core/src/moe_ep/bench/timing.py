"""Timed runs: medians of several runs after warm-up, measured round-robin so load drifts
hit everything alike; wall time on CPU, CUDA events on a GPU (that path has never run on a
GPU)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Samples:
    """Seconds of each timed run of one thing."""

    runs: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def spread(self) -> str:
        """min-max over the runs in ms, as a text."""
        return f"{min(self.runs) * 1e3:.1f}-{max(self.runs) * 1e3:.1f}"


def _timed(fn: Callable[[], object], device: torch.device | None) -> float:
    if device is not None and device.type == "cuda":
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def round_robin(
    fns: dict[str, Callable[[], object]],
    reps: int,
    *,
    warmup: int = 1,
    barrier: Callable[[], object] | None = None,
    device: torch.device | None = None,
) -> dict[str, Samples]:
    """Every fn `warmup` times, then `reps` rounds of each in turn; `barrier` (collective
    runs: every rank starts each run together) before each timed run; on a CUDA `device`
    each run is timed by CUDA events on the current stream."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    out = {name: Samples() for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if barrier is not None:
                barrier()
            out[name].runs.append(_timed(fn, device))
    return out

"""The machine's memory read bandwidth, as a benchmark's limit for weight-streaming work."""

from __future__ import annotations

import time

import torch

STREAM_BYTES = 1 << 30
"""Bytes read per measurement: far past any last-level cache (tens of MiB)."""


def read_bandwidth(reps: int, nbytes: int = STREAM_BYTES) -> list[float]:
    """Bytes per second of `reps` streaming reads (a `sum` over an fp32 buffer of `nbytes`,
    at torch's current intra-op thread count), one value per read."""
    buf = torch.ones(nbytes // 4)
    buf.sum()  # pages touched, threads started
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        rates.append(nbytes / (time.perf_counter() - start))
    return rates

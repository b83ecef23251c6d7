"""Will the ranks `moe-ep run` spawns fit this machine? A host-memory estimate per rank from
the shape, against available memory and CPU cores, said before spawning."""

from __future__ import annotations

import os
from pathlib import Path

from moe_ep.cli.problem import ORACLE_CHUNK_BYTES, JobSpec, oracle_bytes_per_expert
from moe_ep.device import usable_cpus

__all__ = [
    "RANK_BASELINE_BYTES",
    "available_memory_bytes",
    "capacity_warnings",
    "rank_memory_bytes",
]

RANK_BASELINE_BYTES = 256 << 20
"""A rank's own memory before any tensor: interpreter, gloo, allocator caches (about 100 MiB
measured on CPU beyond the torch pages it shares with the forkserver), with margin."""

_GIB = float(1 << 30)


def rank_memory_bytes(spec: JobSpec) -> int:
    """Estimated peak host memory of one rank of `spec` (the worst-loaded rank)."""
    n, h, i, e, k, ws = (
        spec.tokens,
        spec.hidden,
        spec.intermediate,
        spec.experts,
        spec.topk,
        spec.world_size,
    )
    # 4x the shard's bf16 weights: the pack, the kernel's prepared copy, validation and
    # generation temporaries (3.3x measured, bf16 on CPU)
    weights = spec.local_experts * 3 * i * h * 2 * 4
    rows = n * k + (int(0.7 * n * ws) if spec.routing == "skewed" else 0)  # rows received
    per_row = h * 2 * 2 + 2 * i * 4 + i * 2 + h * 4  # in + staged, FC1 fp32, SwiGLU, FC2 fp32
    tokens = n * h * 2 * 2 + n * e * 4  # hidden states and output, routing scores
    oracle = 0
    if spec.check:
        chunk = min(e, max(1, ORACLE_CHUNK_BYTES // oracle_bytes_per_expert(spec)))
        # a weight chunk, the per-(token, slot) FC2 outputs and flips, four [n, H] f64 sums
        oracle = chunk * oracle_bytes_per_expert(spec) + 2 * n * k * h * 8 + 4 * n * h * 8
    return RANK_BASELINE_BYTES + weights + rows * per_row + tokens + oracle


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else free physical pages; None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def capacity_warnings(spec: JobSpec, *, on_cuda: bool) -> list[str]:
    """One line per way the ranks of `spec` would overload this machine (none if they fit)."""
    warnings = []
    ws = spec.world_size
    per_rank = rank_memory_bytes(spec)
    available = available_memory_bytes()
    if available is not None and ws * per_rank > available:
        check = ", the oracle check included" if spec.check else ""
        warnings.append(
            f"--world-size {ws}: the ranks need about {ws * per_rank / _GIB:.1f} GiB of host "
            f"memory ({per_rank / _GIB:.2f} GiB each for this shape{check}) but "
            f"{available / _GIB:.1f} GiB is available; the out-of-memory killer may stop them "
            "(use fewer ranks or a smaller shape)"
        )
    cores = usable_cpus()
    if not on_cuda and ws > cores:
        warnings.append(
            f"--world-size {ws}: more ranks than the {cores} CPU core(s) available; the ranks "
            "time-share them (one intra-op thread each) and run slowly"
        )
    return warnings

"""What machine a benchmark ran on: one line for titles and tables, a dict for JSON."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_ep.device import usable_cpus

CPUINFO = Path("/proc/cpuinfo")
SIMD_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "amx_bf16",
    "amx_tile",
    "asimd",
    "sve",
    "bf16",
)
"""The /proc/cpuinfo flags that decide which GEMM kernels torch and the fused library run."""


def cpu_model(cpuinfo: str | None) -> str:
    """The CPU's model name from the text of /proc/cpuinfo (its first "model name" line),
    else what `platform` knows (processor, then machine), else "unknown CPU"."""
    for line in (cpuinfo or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name" and value.strip():
            return " ".join(value.split())
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_flags(cpuinfo: str | None) -> tuple[str, ...]:
    """The `SIMD_FLAGS` this CPU has, from the first "flags" (x86) or "Features" (arm) line
    of /proc/cpuinfo's text; empty when unknown."""
    for line in (cpuinfo or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            have = set(value.split())
            return tuple(f for f in SIMD_FLAGS if f in have)
    return ()


def _read_cpuinfo() -> str | None:
    try:
        return CPUINFO.read_text()
    except OSError:
        return None


@dataclass(frozen=True)
class Machine:
    """The CPU model, its logical CPUs (all, and those this process may run on), the torch
    version and the intra-op thread counts the benchmark used."""

    cpu: str
    logical_cpus: int
    usable_cpus: int
    torch_version: str
    threads: tuple[int, ...]
    flags: tuple[str, ...] = ()
    load_average: float | None = None
    """The 1-minute load average when described (None where unknown): figures taken above
    about 1 on a small machine are noisy."""

    def describe(self) -> str:
        """One line, e.g. "AMD EPYC, 2 logical CPUs (2 usable), torch 2.15.0, 1 and 2
        intra-op threads"."""
        usable = f" ({self.usable_cpus} usable)" if self.usable_cpus != self.logical_cpus else ""
        counts = [str(t) for t in self.threads]
        listed = counts[0] if len(counts) == 1 else ", ".join(counts[:-1]) + " and " + counts[-1]
        noun = "thread" if counts == ["1"] else "threads"
        return (
            f"{self.cpu}, {self.logical_cpus} logical CPUs{usable}, torch {self.torch_version}, "
            f"{listed} intra-op {noun}"
        )

    def as_dict(self) -> dict[str, object]:
        """The JSON form: every field, plus the one-line description."""
        return {
            "cpu": self.cpu,
            "flags": list(self.flags),
            "logical_cpus": self.logical_cpus,
            "usable_cpus": self.usable_cpus,
            "torch_version": self.torch_version,
            "threads": list(self.threads),
            "load_average_1min": self.load_average,
            "description": self.describe(),
        }


def this_machine(threads: Sequence[int] | None = None) -> Machine:
    """This machine; `threads` defaults to torch's current intra-op thread count."""
    logical = os.cpu_count() or 1
    usable = usable_cpus()
    info = _read_cpuinfo()
    try:
        load: float | None = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return Machine(
        cpu=cpu_model(info),
        logical_cpus=logical,
        usable_cpus=usable,
        torch_version=torch.__version__,
        threads=tuple(threads) if threads else (torch.get_num_threads(),),
        flags=cpu_flags(info),
        load_average=load,
    )

"""What machine a benchmark ran on, in one line for titles and tables."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")


def cpu_model(cpuinfo: str | None) -> str:
    """The CPU's model name from the text of /proc/cpuinfo (its first "model name" line),
    else what `platform` knows (processor, then machine), else "unknown CPU"."""
    for line in (cpuinfo or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "model name" and value.strip():
            return " ".join(value.split())
    return platform.processor() or platform.machine() or "unknown CPU"


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


def this_machine(threads: Sequence[int] | None = None) -> Machine:
    """This machine; `threads` defaults to torch's current intra-op thread count."""
    logical = os.cpu_count() or 1
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = logical
    return Machine(
        cpu=cpu_model(_read_cpuinfo()),
        logical_cpus=logical,
        usable_cpus=usable,
        torch_version=torch.__version__,
        threads=tuple(threads) if threads else (torch.get_num_threads(),),
    )

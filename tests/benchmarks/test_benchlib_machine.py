"""`moe_ep.bench.machine`: the line that titles every benchmark table and plot."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from moe_ep.bench.machine import Machine, cpu_model, this_machine

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R)   Platinum 8488C
flags\t\t: fpu avx512f amx_tile

processor\t: 1
model name\t: Intel(R) Xeon(R)   Platinum 8488C
"""


def test_cpu_model_is_the_first_model_name_of_cpuinfo() -> None:
    assert cpu_model(CPUINFO) == "Intel(R) Xeon(R) Platinum 8488C"


def test_cpu_model_falls_back_to_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "processor", lambda: "")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert cpu_model("processor\t: 0\nmodel name\t:   \n") == "aarch64"  # empty name
    assert cpu_model(None) == "aarch64"  # no /proc/cpuinfo
    monkeypatch.setattr(platform, "machine", lambda: "")
    assert cpu_model(None) == "unknown CPU"


def test_describe_names_cpu_counts_torch_and_threads() -> None:
    m = Machine("AMD EPYC", 16, 2, "2.15.0", (1, 2))
    assert m.describe() == (
        "AMD EPYC, 16 logical CPUs (2 usable), torch 2.15.0, 1 and 2 intra-op threads"
    )
    one = Machine("AMD EPYC", 2, 2, "2.15.0", (1,))
    assert one.describe() == "AMD EPYC, 2 logical CPUs, torch 2.15.0, 1 intra-op thread"
    three = Machine("x", 8, 8, "2.8.0", (1, 2, 4))
    assert three.describe().endswith("1, 2 and 4 intra-op threads")


def test_this_machine_reads_this_process() -> None:
    m = this_machine()
    assert m.logical_cpus == os.cpu_count()
    assert m.usable_cpus == len(os.sched_getaffinity(0))
    assert m.torch_version == torch.__version__
    assert m.threads == (torch.get_num_threads(),)
    assert this_machine([1, 2]).threads == (1, 2)
    assert m.cpu and m.cpu in m.describe()

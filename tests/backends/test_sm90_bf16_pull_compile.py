"""Compile-only check of `sm90_bf16_bf16_bf16_pull_cutedsl` (no GPU needed).

The drop's bf16 kernel is compiled for sm_90a with exactly the constructor and call
arguments the launch path builds (the kernel's `args`), in a fresh process per compile
(`python -m moe_ep_sm90.compile_check bf16-pull`), and the same arguments are refused for
a Blackwell target (the check means something).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from backend_testing import require_drop, run_compile_check

from moe_ep_sm90.common.pull_drop import PULL_DROP


def _compile(tmp_path: Path, arch: str, *extra: str) -> dict:
    require_drop(PULL_DROP, cutlass=True)
    return run_compile_check(tmp_path, "moe_ep_sm90.compile_check", arch, "bf16-pull", *extra)


def test_bf16_pull_kernel_compiles_for_sm90a(tmp_path):
    result = _compile(tmp_path, "sm_90a")
    assert result["ok"], result
    assert result["kernel"] == "sm90_bf16_bf16_bf16_pull_cutedsl"
    assert result["arch"] == "sm_90a"
    assert result["detail"]  # the compiled-function type reported by cute.compile


def test_bf16_pull_kernel_refuses_a_blackwell_target(tmp_path):
    result = _compile(tmp_path, "sm_100a")
    assert not result["ok"]
    assert "expects arch to be sm_90a" in result["error"]


@pytest.mark.slow
def test_bf16_pull_kernel_swap_ab_compiles_for_sm90a(tmp_path):
    result = _compile(tmp_path, "sm_90a", "--swap-ab")
    assert result["ok"], result

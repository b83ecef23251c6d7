"""Compile-only checks of the sm100 CuTe DSL kernels (nvfp4, mxfp8) for sm_100a (no GPU).

Built from `moe_ep_sm100.nvfp4_args` / `mxfp8_args` in a fresh process (the drop owns generic
top-level module names; the CuTe DSL reads the target arch from the environment).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from backend_testing import require_drop, run_compile_check

from moe_ep_sm100.drops import CUTEDSL_DROP


def _compile(tmp_path: Path, arch: str, kernel: str = "nvfp4") -> dict:
    require_drop(CUTEDSL_DROP)
    return run_compile_check(tmp_path, "moe_ep_sm100.compile_check", arch, kernel)


@pytest.mark.parametrize("kernel", ["nvfp4", "mxfp8"])
def test_kernel_compiles_for_sm100a(tmp_path, kernel):
    result = _compile(tmp_path, "sm_100a", kernel)
    assert result["ok"], result
    assert result["kernel"] == f"sm100_{kernel}_{kernel}_bf16_cutedsl"


@pytest.mark.slow
def test_nvfp4_kernel_refuses_a_hopper_target(tmp_path):
    result = _compile(tmp_path, "sm_90a")
    assert not result["ok"]
    assert "sm_90" in result["error"]

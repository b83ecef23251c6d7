"""Compile-only checks of the sm100 CuTe DSL kernels (nvfp4, mxfp8) for sm_100a (no GPU).

Built from `moe_ep_sm100.nvfp4_args` / `mxfp8_args` in a fresh process (the drop owns generic
top-level module names; the CuTe DSL reads the target arch from the environment).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_ep_sm100.drops import CUTEDSL_DROP


def _compile(tmp_path: Path, arch: str, kernel: str = "nvfp4") -> dict:
    why = CUTEDSL_DROP.reason()
    if why:
        pytest.skip(why)
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("nvidia-cutlass-dsl is not installed (import cutlass)")
    env = {
        **os.environ,
        "CUTE_DSL_ARCH": arch,
        "CUTE_DSL_CACHE_DIR": str(tmp_path / "cute_cache"),
        "CUTE_DSL_NO_CACHE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "moe_ep_sm100.compile_check", kernel, "--arch", arch],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result line; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert (proc.returncode == 0) == result["ok"]
    return result


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

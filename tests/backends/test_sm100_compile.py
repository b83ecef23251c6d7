"""Compile-only checks of the sm100 CuTe DSL kernels (nvfp4, mxfp8) for sm_100a (no GPU).

Built from the kernels' `args` modules in a fresh process (the drop owns generic
top-level module names; the CuTe DSL reads the target arch from the environment).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from backend_testing import require_drop, run_compile_check
from sm100_fakes import install_fake_gpu

from moe_ep_sm100.common.cutedsl import CUTEDSL_DROP


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


def test_mxfp8_workspace_fakes_have_the_launch_paths_extents(monkeypatch):
    # The launch passes the mxfp8 workspaces as from_dlpack uint8 tensors (the drop's runner
    # does too): local static, shared marked dynamic on dim 0, which gives a 32-bit extent
    # (`fake_gmem_tensor` builds exactly that, `test_compile_fakes`); the check's fake had a
    # 64-bit one, a kernel specialisation the launch never runs.
    from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.compile import mxfp8_fake_workspace

    gpu = install_fake_gpu(monkeypatch, world_size=1, rank=0)
    mxfp8_fake_workspace("local_workspace", 1000)
    mxfp8_fake_workspace("shared_workspace", 1000)
    local, shared = gpu.fake_tensors
    assert local == ("compact", "cutlass.Uint8", (1000,), None, 16)
    assert shared == ("strided", "cutlass.Uint8", ("sym_int32",), (1,), 16)

"""Compile-only check of the NVFP4 x FP8 pull kernel (no GPU): FlashInfer's
`Sm90MegaMoESwapABNvfp4Fp8Kernel` (the `sm90_pull_nvfp4` drop, over the `sm90_pull_cutedsl`
drop's MXFP4 kernel) built with exactly our constructor and call arguments
(`sm90_fp8_nvfp4_bf16_pull_cutedsl.args`) compiles for sm_90a, and the same arguments for
sm_100a fail (Hopper-only WGMMA), in a fresh process per compile."""

from __future__ import annotations

from pathlib import Path

from backend_testing import require_drop, run_compile_check

from moe_ep_sm90.common.pull_drop import PULL_DROP
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.upstream import NVFP4_DROP


def _compile(tmp_path: Path, arch: str) -> dict:
    require_drop(PULL_DROP, cutlass=True)
    require_drop(NVFP4_DROP, cutlass=True)
    return run_compile_check(tmp_path, "moe_ep_sm90.compile_check", arch, "nvfp4-pull")


def test_nvfp4_pull_kernel_compiles_for_sm90a(tmp_path: Path) -> None:
    result = _compile(tmp_path, "sm_90a")
    assert result["ok"], result
    assert result["arch"] == "sm_90a" and result["kernel"] == "sm90_fp8_nvfp4_bf16_pull_cutedsl"
    assert result["detail"]


def test_nvfp4_pull_kernel_refuses_a_blackwell_target(tmp_path: Path) -> None:
    result = _compile(tmp_path, "sm_100a")
    assert not result["ok"]
    assert "sm_90a" in result["error"]

"""The NVFP4 x FP8 pull kernel's compile-only check (no GPU): `common.pull_compile` with this
kernel's `args` (`python -m moe_ep_sm90.compile_check nvfp4-pull`)."""

from __future__ import annotations

from moe_ep.backends.support.cutedsl.compile_fakes import DEFAULT_CHECK_GEOMETRY
from moe_ep.backends.support.launch_args import LaunchGeometry
from moe_ep_sm90.common.compile_result import CompileResult
from moe_ep_sm90.common.pull_compile import compile_pull_kernel
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.args import build_kernel, tensor_specs
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.upstream import load_nvfp4_api

__all__ = ["compile_nvfp4_pull"]


def compile_nvfp4_pull(
    config: Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig,
    geometry: LaunchGeometry = DEFAULT_CHECK_GEOMETRY,
    *,
    arch: str = "sm_90a",
) -> CompileResult:
    """Compile the NVFP4 kernel for `arch` with fake tensors (`CUTE_DSL_ARCH` set)."""
    return compile_pull_kernel(
        config,
        geometry,
        arch=arch,
        load_api=load_nvfp4_api,
        build_kernel=build_kernel,
        tensor_specs=tensor_specs,
    )

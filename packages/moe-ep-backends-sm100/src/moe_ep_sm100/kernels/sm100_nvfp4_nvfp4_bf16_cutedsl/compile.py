"""The nvfp4 kernel's compile-only check (no GPU): CuTe DSL with fake gmem tensors, built
from `args` (the arguments a launch would use). Run it in a fresh process through
`python -m moe_ep_sm100.compile_check nvfp4`."""

from __future__ import annotations

from moe_ep.backends.support.cutedsl.compile_fakes import (
    DEFAULT_CHECK_GEOMETRY,
    fake_call_inputs,
    fake_pointer,
    require_cute_dsl_arch,
    timed_compile,
)
from moe_ep.backends.support.launch_args import LaunchGeometry, check_config_geometry
from moe_ep_sm100.common.config import BLACKWELL_SM_COUNT
from moe_ep_sm100.common.cutedsl import combine_region, fake_tensor
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.args import build_kernel, call_args
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.config import (
    Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.upstream import load_nvfp4_api

__all__ = ["compile_nvfp4"]


def compile_nvfp4(
    config: Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    geometry: LaunchGeometry = DEFAULT_CHECK_GEOMETRY,
    *,
    arch: str = "sm_100a",
) -> float:
    """Compile for `arch` with fake tensors; returns seconds. Needs `CUTE_DSL_ARCH=<arch>`."""
    require_cute_dsl_arch(arch)
    check_config_geometry(config, geometry)
    api = load_nvfp4_api()
    kernel, clusters = build_kernel(config, geometry, api, sm_count=BLACKWELL_SM_COUNT)
    combine_region(kernel, geometry)  # the cells the launch path clears exist, as assumed
    inputs = fake_call_inputs(fake_tensor, api.sym_buffer_host, geometry, clusters)
    args = call_args(geometry, pointer=fake_pointer, **inputs)
    return timed_compile(kernel, args, arch, config=config, geometry=geometry)[1]

"""The kernel's compile-only check (no GPU): CuTe DSL with fake gmem tensors, built from
`args` (the descriptors and arguments a launch would use). Run it in a fresh process through
`python -m moe_ep_sm100.compile_check mxfp8_mxfp4` (the CuTe DSL reads the target arch from
the environment when cutlass is imported)."""

from __future__ import annotations

from moe_ep.backends.support.cutedsl.compile_fakes import (
    DEFAULT_CHECK_GEOMETRY,
    FAKE_ADDRESS,
    fake_peer_map,
    require_cute_dsl_arch,
    timed_compile,
)
from moe_ep.backends.support.launch_args import LaunchGeometry, check_config_geometry
from moe_ep_sm100.common.config import BLACKWELL_SM_COUNT
from moe_ep_sm100.common.cutedsl import fake_tensor
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.args import build_kernel, call_args
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.upstream import load_api

__all__ = ["compile_mxfp8_mxfp4"]


def compile_mxfp8_mxfp4(
    config: Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig,
    geometry: LaunchGeometry = DEFAULT_CHECK_GEOMETRY,
    *,
    arch: str = "sm_100a",
) -> float:
    """Compile the kernel for `arch` with fake tensors; returns seconds."""
    import cuda.bindings.driver as cuda

    require_cute_dsl_arch(arch)
    check_config_geometry(config, geometry)
    api = load_api()
    kernel, _ = build_kernel(config, geometry, api, sm_count=BLACKWELL_SM_COUNT)
    args = call_args(
        geometry,
        tensor=fake_tensor,
        workspaces=(FAKE_ADDRESS, FAKE_ADDRESS),
        peer_map=fake_peer_map(api.sym_buffer_host, geometry),  # type: ignore[arg-type]
        stream=cuda.CUstream(0),
    )
    return timed_compile(kernel, args, arch, config=config, geometry=geometry)[1]

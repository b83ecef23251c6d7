"""The mxfp8 kernel's compile-only check (no GPU): CuTe DSL with fake gmem tensors, built
from `args` (the arguments a launch would use). Run it in a fresh process through
`python -m moe_ep_sm100.compile_check mxfp8`."""

from __future__ import annotations

from typing import Any

from moe_ep.backends.support.cutedsl.compile_fakes import (
    DEFAULT_CHECK_GEOMETRY,
    fake_call_inputs,
    fake_gmem_tensor,
    require_cute_dsl_arch,
    timed_compile,
)
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, check_config_geometry
from moe_ep_sm100.common.config import BLACKWELL_SM_COUNT
from moe_ep_sm100.common.cutedsl import combine_region, fake_tensor
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.args import build_kernel, call_args
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.upstream import load_mxfp8_api

__all__ = ["compile_mxfp8", "mxfp8_fake_workspace"]


def mxfp8_fake_workspace(name: str, local_bytes: int) -> Any:
    """The mxfp8 kernel's uint8 workspace `name` as the launch passes it: `from_dlpack` of
    the local workspace keeps its static extent `local_bytes`; the shared one is marked
    dynamic on dim 0, which gives a 32-bit extent (`fake_gmem_tensor`; a 64-bit one would
    compile another specialisation than the launch runs)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.typing import AddressSpace

    if name == "local_workspace":
        return cute.runtime.make_fake_compact_tensor(
            cutlass.Uint8, (local_bytes,), memspace=AddressSpace.gmem, assumed_align=16
        )
    return fake_gmem_tensor(ArgSpec(name, (1,), "uint8", 0), cutlass.Uint8)


def compile_mxfp8(
    config: Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    geometry: LaunchGeometry = DEFAULT_CHECK_GEOMETRY,
    *,
    arch: str = "sm_100a",
) -> float:
    """Compile the mxfp8 kernel for `arch` with fake tensors; returns seconds."""
    require_cute_dsl_arch(arch)
    check_config_geometry(config, geometry)
    api = load_mxfp8_api()
    kernel, clusters = build_kernel(config, geometry, api, sm_count=BLACKWELL_SM_COUNT)
    local_bytes, _ = kernel.get_workspace_sizes()
    combine_region(kernel, geometry)  # the cells the launch path clears exist, as assumed

    def workspace(name: str) -> Any:
        return mxfp8_fake_workspace(name, local_bytes)

    inputs = fake_call_inputs(fake_tensor, api.sym_buffer_host, geometry, clusters)
    args = call_args(
        geometry, pool_token_capacity=kernel.pool_token_capacity, workspace=workspace, **inputs
    )
    return timed_compile(kernel, args, arch, config=config, geometry=geometry)[1]

"""The MXFP4 x FP8 pull kernel's compile-only check (no GPU): CuTe DSL with fake gmem tensors,
built exactly as `args` builds it. Run it in a fresh process through
`python -m moe_ep_sm90.compile_check mxfp4-pull` (see the fp8 pull kernel's `compile`).
"""

from __future__ import annotations

from typing import Any

from moe_ep.backends.support.cutedsl.compile_fakes import (
    DEFAULT_CHECK_GEOMETRY,
    fake_call_inputs,
    fake_gmem_tensor,
    fake_pointer,
    require_cute_dsl_arch,
    timed_compile,
)
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, check_config_geometry
from moe_ep_sm90.common.compile_result import CompileResult
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.args import build_kernel, call_args
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
)

__all__ = ["compile_mxfp4_pull"]


def compile_mxfp4_pull(
    config: Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
    geometry: LaunchGeometry = DEFAULT_CHECK_GEOMETRY,
    *,
    arch: str = "sm_90a",
) -> CompileResult:
    """Compile the MXFP4 kernel for `arch` with fake tensors; raises what cute.compile raises.
    The environment must already carry `CUTE_DSL_ARCH=<arch>`."""
    require_cute_dsl_arch(arch)
    import cutlass

    from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.upstream import load_mxfp4_api

    check_config_geometry(config, geometry)
    api = load_mxfp4_api()
    kernel, clusters = build_kernel(config, geometry, api)
    dtypes = {
        "float8_e4m3fn": cutlass.Float8E4M3FN,
        "float32": cutlass.Float32,
        "int64": cutlass.Int64,
        "bfloat16": cutlass.BFloat16,
        "uint8": cutlass.Uint8,
    }

    def fake(spec: ArgSpec) -> Any:
        return fake_gmem_tensor(spec, dtypes[spec.dtype])

    inputs = fake_call_inputs(fake, api.sym_buffer_host, geometry, clusters)
    args = call_args(geometry, pointer=fake_pointer, **inputs)
    compiled, seconds = timed_compile(kernel, args, arch)
    return CompileResult("sm90_fp8_mxfp4_bf16_pull_cutedsl", arch, seconds, type(compiled).__name__)

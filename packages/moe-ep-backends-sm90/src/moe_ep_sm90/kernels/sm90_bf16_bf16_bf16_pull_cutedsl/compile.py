"""The bf16 pull kernel's compile-only check (no GPU): CuTe DSL with fake gmem tensors.

Builds the kernel exactly as the launch path does (`args.build_kernel`), reads its
combine-cell region as the launch path does (`common.pull_drop.combine_region`), and
compiles it with fake global-memory tensors. Run it in a fresh process through
`python -m moe_ep_sm90.compile_check bf16-pull` (the drop owns generic top-level module
names, and the CuTe DSL reads the target arch from the environment at import).
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
from moe_ep_sm90.common.pull_drop import combine_region
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.args import build_kernel, call_args
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.config import (
    Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig,
)

__all__ = ["compile_bf16_pull"]


def compile_bf16_pull(
    config: Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig,
    geometry: LaunchGeometry = DEFAULT_CHECK_GEOMETRY,
    *,
    arch: str = "sm_90a",
) -> CompileResult:
    """Compile the bf16 pull kernel for `arch` with fake tensors; raises whatever
    cute.compile raises. The environment must already carry `CUTE_DSL_ARCH=<arch>`."""
    require_cute_dsl_arch(arch)
    import cutlass

    from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.upstream import (
        load_bf16_pull_api,
    )

    check_config_geometry(config, geometry)
    api = load_bf16_pull_api()
    kernel, clusters = build_kernel(config, geometry, api)
    combine_region(kernel, geometry)  # the cells the launch path clears exist, as assumed
    dtypes = {"float32": cutlass.Float32, "int64": cutlass.Int64, "bfloat16": cutlass.BFloat16}

    def fake(spec: ArgSpec) -> Any:
        return fake_gmem_tensor(spec, dtypes[spec.dtype])

    inputs = fake_call_inputs(fake, api.sym_buffer_host, geometry, clusters)
    args = call_args(geometry, pointer=fake_pointer, **inputs)
    compiled, seconds = timed_compile(kernel, args, arch)
    return CompileResult("sm90_bf16_bf16_bf16_pull_cutedsl", arch, seconds, type(compiled).__name__)

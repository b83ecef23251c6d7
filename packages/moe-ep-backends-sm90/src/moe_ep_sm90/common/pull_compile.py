"""The sm90 pull kernels' compile-only check (no GPU): CuTe DSL with fake gmem tensors.

Builds a kernel exactly as its launch path does (its `args.build_kernel`), reads its
combine-cell region as the launch path does (`pull_drop.combine_region`), and compiles it
with fake global-memory tensors instead of CUDA tensors. Run it in a fresh process through
`python -m moe_ep_sm90.compile_check` (the drop owns generic top-level module names, and the
CuTe DSL reads the target arch from the environment at import).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_ep.backends.support.cutedsl.compile_fakes import (
    fake_call_inputs,
    fake_gmem_tensor,
    fake_pointer,
    require_cute_dsl_arch,
    timed_compile,
)
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, check_config_geometry
from moe_ep_sm90.common.compile_result import CompileResult
from moe_ep_sm90.common.pull_args import pull_call_args
from moe_ep_sm90.common.pull_drop import combine_region

__all__ = ["compile_pull_kernel"]

_CUTLASS_DTYPES = {
    "float8_e4m3fn": "Float8E4M3FN",
    "float32": "Float32",
    "int64": "Int64",
    "bfloat16": "BFloat16",
    "uint8": "Uint8",  # the MXFP4 kernel's packed weights and offsets
}


def compile_pull_kernel(
    config: Any,
    geometry: LaunchGeometry,
    *,
    arch: str,
    load_api: Callable[[], Any],
    build_kernel: Callable[[Any, LaunchGeometry, Any], tuple[Any, int]],
    tensor_specs: Callable[[LaunchGeometry], tuple[ArgSpec, ...]],
) -> CompileResult:
    """Compile one pull kernel (`config.kernel_name`) for `arch` with fake tensors; raises
    whatever cute.compile raises. `CUTE_DSL_ARCH=<arch>` must already be set (read when
    cutlass imports)."""
    require_cute_dsl_arch(arch)
    import cutlass

    check_config_geometry(config, geometry)
    api = load_api()
    kernel, clusters = build_kernel(config, geometry, api)
    combine_region(kernel, geometry)  # the cells the launch path clears exist, as assumed

    def fake(spec: ArgSpec) -> Any:
        return fake_gmem_tensor(spec, getattr(cutlass, _CUTLASS_DTYPES[spec.dtype]))

    inputs = fake_call_inputs(fake, api.sym_buffer_host, geometry, clusters)
    args = pull_call_args(tensor_specs(geometry), pointer=fake_pointer, **inputs)
    compiled, seconds = timed_compile(kernel, args, arch, config=config, geometry=geometry)
    return CompileResult(config.kernel_name, arch, seconds, type(compiled).__name__)

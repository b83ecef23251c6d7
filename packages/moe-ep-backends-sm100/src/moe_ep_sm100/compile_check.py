"""Compile-only checks (no GPU) of the sm100 CuTe DSL kernels (nvfp4, mxfp8) for `sm_100a`.

Builds each kernel from `nvfp4_args` / `mxfp8_args` (the arguments a launch would use) with
fake gmem tensors and compiles it. Run in a fresh process (the drop owns generic top-level module
names; the CuTe DSL reads the target arch from the environment at import):

    CUTE_DSL_ARCH=sm_100a python -m moe_ep_sm100.compile_check {nvfp4|mxfp8} --arch sm_100a

Prints one JSON line; exit code 0 on success.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from moe_ep.backends.support.args import check_config_geometry
from moe_ep.backends.support.compile_check import (
    DEFAULT_CHECK_GEOMETRY,
    fake_call_inputs,
    fake_gmem_tensor,
    fake_pointer,
    require_cute_dsl_arch,
    timed_compile,
)
from moe_ep_sm100 import mxfp8_args, nvfp4_args
from moe_ep_sm100.configs import (
    BLACKWELL_SM_COUNT,
    Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.cutedsl_launch import combine_region
from moe_ep_sm100.drops import load_mxfp8_api, load_nvfp4_api
from moe_ep_sm100.nvfp4_args import ArgSpec, Geometry, call_args

__all__ = [
    "DEFAULT_GEOMETRY",
    "compile_mxfp8",
    "compile_nvfp4",
    "load_mxfp8_api",
    "load_nvfp4_api",
    "main",
    "mxfp8_fake_workspace",
]

DEFAULT_GEOMETRY = DEFAULT_CHECK_GEOMETRY


def _fake(spec: ArgSpec) -> Any:
    """Fake gmem tensor of the kernel dtype for `spec` (see `fake_gmem_tensor`)."""
    import cutlass

    dtypes = {
        "fp4": cutlass.Float4E2M1FN,
        "fp8_e4m3": cutlass.Float8E4M3FN,
        "e8m0": cutlass.Float8E8M0FNU,
        "float32": cutlass.Float32,
        "int64": cutlass.Int64,
        "bfloat16": cutlass.BFloat16,
    }
    return fake_gmem_tensor(spec, dtypes[spec.dtype])


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


def compile_nvfp4(
    config: Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    geometry: Geometry = DEFAULT_GEOMETRY,
    *,
    arch: str = "sm_100a",
) -> float:
    """Compile for `arch` with fake tensors; returns seconds. Needs `CUTE_DSL_ARCH=<arch>`."""
    require_cute_dsl_arch(arch)
    check_config_geometry(config, geometry)
    api = load_nvfp4_api()
    kernel, clusters = nvfp4_args.build_kernel(config, geometry, api, sm_count=BLACKWELL_SM_COUNT)
    combine_region(kernel, geometry)  # the cells the launch path clears exist, as assumed
    inputs = fake_call_inputs(_fake, api.sym_buffer_host, geometry, clusters)
    args = call_args(geometry, pointer=fake_pointer, **inputs)
    return timed_compile(kernel, args, arch)[1]


def compile_mxfp8(
    config: Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    geometry: Geometry = DEFAULT_GEOMETRY,
    *,
    arch: str = "sm_100a",
) -> float:
    """Compile the mxfp8 kernel for `arch` with fake tensors; returns seconds."""
    require_cute_dsl_arch(arch)
    check_config_geometry(config, geometry)
    api = load_mxfp8_api()
    kernel, clusters = mxfp8_args.build_kernel(config, geometry, api, sm_count=BLACKWELL_SM_COUNT)
    local_bytes, _ = kernel.get_workspace_sizes()
    combine_region(kernel, geometry)  # the cells the launch path clears exist, as assumed

    def workspace(name: str) -> Any:
        return mxfp8_fake_workspace(name, local_bytes)

    inputs = fake_call_inputs(_fake, api.sym_buffer_host, geometry, clusters)
    args = mxfp8_args.call_args(geometry, workspace=workspace, **inputs)
    return timed_compile(kernel, args, arch)[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ep_sm100.compile_check")
    parser.add_argument("kernel", choices=["nvfp4", "mxfp8"])
    parser.add_argument("--arch", default="sm_100a")
    args = parser.parse_args(argv)
    try:
        if args.kernel == "nvfp4":
            cfg = Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig()
            seconds = compile_nvfp4(cfg, arch=args.arch)
        else:
            seconds = compile_mxfp8(Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig(), arch=args.arch)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000]}))
        return 1
    kernel = f"sm100_{args.kernel}_{args.kernel}_bf16_cutedsl"
    print(json.dumps({"ok": True, "kernel": kernel, "arch": args.arch, "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

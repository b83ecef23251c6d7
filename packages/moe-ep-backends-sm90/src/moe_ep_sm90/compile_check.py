"""Compile-only checks (no GPU): the pull kernel with CuTe DSL, the push units with nvcc.

The pull check builds the kernel exactly as the launch path does (`pull_args`), reads its
combine-cell region as the launch path does (`pull_cutedsl.combine_region`), and compiles it
with fake global-memory tensors instead of CUDA tensors for `sm_90a`. Run it in a
fresh process (the drop owns generic top-level module names, and the CuTe DSL reads the
target arch from the environment at import):

    CUTE_DSL_ARCH=sm_90a python -m moe_ep_sm90.compile_check pull --arch sm_90a
    python -m moe_ep_sm90.compile_check push-a2a      # or push-binding (~60 s)

Exit code 0 and a JSON line with the compile time on success.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
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
from moe_ep_sm90.configs import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig
from moe_ep_sm90.pull_args import (
    ArgSpec,
    PullGeometry,
    build_kernel,
    call_args,
)
from moe_ep_sm90.pull_cutedsl import combine_region

__all__ = [
    "DEFAULT_PULL_GEOMETRY",
    "CompileResult",
    "compile_pull",
    "compile_push",
    "main",
]

DEFAULT_PULL_GEOMETRY = DEFAULT_CHECK_GEOMETRY


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    arch: str
    seconds: float
    detail: str = ""


def compile_pull(
    config: Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
    geometry: PullGeometry = DEFAULT_PULL_GEOMETRY,
    *,
    arch: str = "sm_90a",
) -> CompileResult:
    """Compile the pull kernel for `arch` with fake tensors; raises whatever cute.compile raises.

    The environment must already carry `CUTE_DSL_ARCH=<arch>` (read when cutlass imports).
    """
    require_cute_dsl_arch(arch)
    import cutlass

    from moe_ep_sm90.drops import load_pull_api

    check_config_geometry(config, geometry)
    api = load_pull_api()
    kernel, clusters = build_kernel(config, geometry, api)
    combine_region(kernel, geometry)  # the cells the launch path clears exist, as assumed
    dtypes = {
        "float8_e4m3fn": cutlass.Float8E4M3FN,
        "float32": cutlass.Float32,
        "int64": cutlass.Int64,
        "bfloat16": cutlass.BFloat16,
    }

    def fake(spec: ArgSpec) -> Any:
        return fake_gmem_tensor(spec, dtypes[spec.dtype])

    inputs = fake_call_inputs(fake, api.sym_buffer_host, geometry, clusters)
    args = call_args(geometry, pointer=fake_pointer, **inputs)
    compiled, seconds = timed_compile(kernel, args, arch)
    return CompileResult("sm90_fp8_fp8_bf16_pull_cutedsl", arch, seconds, type(compiled).__name__)


def compile_push(
    out_dir: Path, unit: str = "a2a", *, arch: str = "sm_90a"
) -> tuple[Path, CompileResult]:
    """`nvcc -cubin` of one push drop unit for `arch` (device code only; no GPU needed).

    `unit`: "a2a" (`a2a/sm90_push_a2a_ops.cu`, ~4 s) or "binding"
    (`fp8_gemm/fp8_moe_binding.cu`, ~60 s). Headers come from the `sm90_push_cuda_deps` drop,
    apache-tvm-ffi and the nvidia-* wheels (`push_build.find_sources`).
    """
    from moe_ep_sm90 import push_build

    s = push_build.find_sources()
    out = out_dir / f"sm90_push_{unit}.cubin"
    if unit == "a2a":
        cmd = push_build.a2a_cubin_command(s, out, arch=arch)
    elif unit == "binding":
        cmd = push_build.binding_cubin_command(s, out_dir / "generated", out, arch=arch)
    else:
        raise ValueError(f"unit must be 'a2a' or 'binding', got {unit!r}")
    seconds = push_build.run(cmd)
    return out, CompileResult(f"sm90_fp8_fp8_bf16_push_cuda:{unit}", arch, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ep_sm90.compile_check")
    parser.add_argument("kernel", choices=["pull", "push-a2a", "push-binding"])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--swap-ab", action="store_true", help="compile the swap-AB layout")
    args = parser.parse_args(argv)
    config = (
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(swap_ab=True, mma_tiler_mnk=(128, 32, 128))
        if args.swap_ab
        else Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig()
    )
    try:
        if args.kernel == "pull":
            result = compile_pull(config, arch=args.arch)
        else:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                _, result = compile_push(Path(tmp), args.kernel[5:], arch=args.arch)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000]}))
        return 1
    print(json.dumps({"ok": True, **result.__dict__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

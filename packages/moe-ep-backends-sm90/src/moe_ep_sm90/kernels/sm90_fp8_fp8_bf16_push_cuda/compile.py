"""The push kernel's compile-only check (no GPU): `nvcc -cubin` of one of the drop's units."""

from __future__ import annotations

from pathlib import Path

from moe_ep_sm90.common.compile_result import CompileResult

__all__ = ["compile_push"]


def compile_push(
    out_dir: Path, unit: str = "a2a", *, arch: str = "sm_90a"
) -> tuple[Path, CompileResult]:
    """`nvcc -cubin` of one push drop unit for `arch` (device code only; no GPU needed).

    `unit`: "a2a" (`a2a/sm90_push_a2a_ops.cu`, ~4 s) or "binding"
    (`fp8_gemm/fp8_moe_binding.cu`, ~60 s). Headers come from the `sm90_push_cuda_deps` drop,
    apache-tvm-ffi and the nvidia-* wheels (`build.find_sources`).
    """
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build

    s = build.find_sources()
    out = out_dir / f"sm90_push_{unit}.cubin"
    if unit == "a2a":
        cmd = build.a2a_cubin_command(s, out, arch=arch)
    elif unit == "binding":
        cmd = build.binding_cubin_command(s, out_dir / "generated", out, arch=arch)
    else:
        raise ValueError(f"unit must be 'a2a' or 'binding', got {unit!r}")
    seconds = build.run(cmd)
    return out, CompileResult(f"sm90_fp8_fp8_bf16_push_cuda:{unit}", arch, seconds)

"""Compile-only checks (no GPU): the pull kernel with CuTe DSL, the push a2a unit with nvcc.

The pull check builds the kernel exactly as the launch path does (`pull_args`), with fake
global-memory tensors instead of CUDA tensors, and compiles it for `sm_90a`. Run it in a
fresh process (the drop owns generic top-level module names, and the CuTe DSL reads the
target arch from the environment at import):

    CUTE_DSL_ARCH=sm_90a python -m moe_ep_sm90.compile_check pull --arch sm_90a [--json]

Exit code 0 and a JSON line with the compile time on success.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_ep_sm90.configs import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig
from moe_ep_sm90.pull_args import (
    ArgSpec,
    PullGeometry,
    call_args,
    kernel_class,
    kernel_ctor_kwargs,
)

__all__ = [
    "DEFAULT_PULL_GEOMETRY",
    "CompileResult",
    "compile_pull",
    "compile_push_a2a",
    "main",
]

# One default shape: 2 ranks, 8 experts (4 local), H=1024, I=512, top-8, 128 tokens per rank.
DEFAULT_PULL_GEOMETRY = PullGeometry(
    world_size=2,
    rank=0,
    max_tokens_per_rank=128,
    top_k=8,
    num_experts=8,
    hidden_size=1024,
    intermediate_size=512,
)


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
    if os.environ.get("CUTE_DSL_ARCH") != arch:
        raise RuntimeError(
            f"CUTE_DSL_ARCH must be {arch!r} before cutlass is imported, got "
            f"{os.environ.get('CUTE_DSL_ARCH')!r}"
        )
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.typing import AddressSpace

    from moe_ep_sm90.drops import load_pull_api

    config.check_problem(
        hidden_size=geometry.hidden_size,
        intermediate_size=geometry.intermediate_size,
        top_k=geometry.top_k,
        num_experts=geometry.num_experts,
        world_size=geometry.world_size,
        max_tokens_per_rank=geometry.max_tokens_per_rank,
    )
    api = load_pull_api()
    clusters = config.resolved_max_active_clusters
    kernel = kernel_class(config, api)(
        **kernel_ctor_kwargs(
            config,
            geometry,
            api=api,
            ab_dtype=cutlass.Float8E4M3FN,
            max_active_clusters=clusters,
        )
    )
    dtypes = {
        "float8_e4m3fn": cutlass.Float8E4M3FN,
        "float32": cutlass.Float32,
        "int64": cutlass.Int64,
        "bfloat16": cutlass.BFloat16,
    }

    def fake(spec: ArgSpec) -> Any:
        # Dynamic extents and strides, stride 1 on the leading dim: what from_dlpack +
        # mark_layout_dynamic give the launch path.
        shape = tuple(cute.sym_int64() for _ in spec.shape)
        stride = tuple(
            1 if d == spec.leading_dim else cute.sym_int64() for d in range(len(spec.shape))
        )
        return cute.runtime.make_fake_tensor(
            dtypes[spec.dtype],
            shape,
            stride=stride,
            memspace=AddressSpace.gmem,
            assumed_align=spec.align,
        )

    def pointer(name: str) -> Any:
        # Any 16-byte aligned address: the compile never dereferences it.
        return cute.runtime.make_ptr(cutlass.Uint8, 1 << 20, AddressSpace.gmem, assumed_align=16)

    peer_map = api.sym_buffer_host(
        base_addr=1 << 30,
        offsets=tuple(r << 32 for r in range(geometry.world_size)),
        rank_idx=geometry.rank,
        num_max_ranks=geometry.world_size,
    )
    args = call_args(
        geometry,
        tensor=fake,
        pointer=pointer,
        peer_map=peer_map,
        stream=cuda.CUstream(0),
        max_active_clusters=clusters,
    )
    start = time.perf_counter()
    compiled = cute.compile(kernel, **args, options=f"--gpu-arch {arch}")
    seconds = time.perf_counter() - start
    return CompileResult("sm90_fp8_fp8_bf16_pull_cutedsl", arch, seconds, type(compiled).__name__)


def compile_push_a2a(
    out_dir: Path,
    *,
    include_dirs: tuple[Path, ...],
    arch: str = "sm_90a",
    nvcc: str = "nvcc",
) -> tuple[Path, CompileResult]:
    """`nvcc -cubin` of the push drop's all-to-all unit for `arch` (device code only).

    `include_dirs` must supply what the drop does not ship: the apache-tvm-ffi headers
    (`tvm/ffi/...`, `dlpack/dlpack.h`) and FlashInfer's `tvm_ffi_utils.h`.
    """
    from moe_ep_sm90.drops import PUSH_DROP

    drop = PUSH_DROP.module()
    src = drop.src_dir() / "a2a" / "sm90_push_a2a_ops.cu"
    out = out_dir / "sm90_push_a2a_ops.cubin"
    cmd = [nvcc, "-std=c++17", f"-arch={arch}", "-cubin", "-o", str(out), str(src)]
    for inc in include_dirs:
        cmd.insert(1, f"-I{inc}")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return out, CompileResult("sm90_fp8_fp8_bf16_push_cuda:a2a", arch, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_ep_sm90.compile_check")
    parser.add_argument("kernel", choices=["pull"])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--swap-ab", action="store_true", help="compile the swap-AB layout")
    args = parser.parse_args(argv)
    config = (
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(swap_ab=True, mma_tiler_mnk=(128, 32, 128))
        if args.swap_ab
        else Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig()
    )
    try:
        result = compile_pull(config, arch=args.arch)
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000]}))
        return 1
    print(json.dumps({"ok": True, **result.__dict__}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

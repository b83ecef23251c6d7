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
import os
import sys
import time
from typing import Any

from moe_ep_sm100 import mxfp8_args
from moe_ep_sm100.configs import (
    BLACKWELL_SM_COUNT,
    Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.drops import load_mxfp8_api, load_nvfp4_api
from moe_ep_sm100.nvfp4_args import (
    ArgSpec,
    Geometry,
    call_args,
    kernel_ctor_kwargs,
)

__all__ = [
    "DEFAULT_GEOMETRY",
    "compile_mxfp8",
    "compile_nvfp4",
    "load_mxfp8_api",
    "load_nvfp4_api",
    "main",
]

# One default shape: 2 ranks, 8 experts (4 local), H=1024, I=512, top-8, 128 tokens per rank.
DEFAULT_GEOMETRY = Geometry(
    world_size=2,
    rank=0,
    max_tokens_per_rank=128,
    top_k=8,
    num_experts=8,
    hidden_size=1024,
    intermediate_size=512,
)


def _check_arch(arch: str) -> None:
    if os.environ.get("CUTE_DSL_ARCH") != arch:
        raise RuntimeError(
            f"CUTE_DSL_ARCH must be {arch!r} before cutlass is imported, got "
            f"{os.environ.get('CUTE_DSL_ARCH')!r}"
        )


def _fake(spec: ArgSpec) -> Any:
    """Fake gmem tensor: dynamic extents and strides, stride 1 on the leading dim."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.typing import AddressSpace

    dtypes = {
        "fp4": cutlass.Float4E2M1FN,
        "fp8_e4m3": cutlass.Float8E4M3FN,
        "e8m0": cutlass.Float8E8M0FNU,
        "float32": cutlass.Float32,
        "int64": cutlass.Int64,
        "bfloat16": cutlass.BFloat16,
    }
    shape = tuple(cute.sym_int64() for _ in spec.shape)
    stride = tuple(1 if d == spec.leading_dim else cute.sym_int64() for d in range(len(spec.shape)))
    return cute.runtime.make_fake_tensor(
        dtypes[spec.dtype],
        shape,
        stride=stride,
        memspace=AddressSpace.gmem,
        assumed_align=spec.align,
    )


def _peer_map(sym_buffer_host: type, g: Geometry) -> Any:
    return sym_buffer_host(
        base_addr=1 << 30,
        offsets=tuple(r << 32 for r in range(g.world_size)),
        rank_idx=g.rank,
        num_max_ranks=g.world_size,
    )


def compile_nvfp4(
    config: Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    geometry: Geometry = DEFAULT_GEOMETRY,
    *,
    arch: str = "sm_100a",
) -> float:
    """Compile for `arch` with fake tensors; returns seconds. Needs `CUTE_DSL_ARCH=<arch>`."""
    _check_arch(arch)
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.typing import AddressSpace

    config.check_problem(
        hidden_size=geometry.hidden_size,
        intermediate_size=geometry.intermediate_size,
        top_k=geometry.top_k,
        num_experts=geometry.num_experts,
        world_size=geometry.world_size,
        max_tokens_per_rank=geometry.max_tokens_per_rank,
    )
    api = load_nvfp4_api()
    kernel = api.kernel(
        **kernel_ctor_kwargs(
            config,
            geometry,
            api=api,
            fc2_output_dtype=cutlass.BFloat16,
            max_active_clusters=BLACKWELL_SM_COUNT,
        )
    )

    def pointer(name: str) -> Any:
        return cute.runtime.make_ptr(cutlass.Uint8, 1 << 20, AddressSpace.gmem, assumed_align=16)

    args = call_args(
        geometry,
        tensor=_fake,
        pointer=pointer,
        peer_map=_peer_map(api.sym_buffer_host, geometry),
        stream=cuda.CUstream(0),
        max_active_clusters=BLACKWELL_SM_COUNT,
    )
    start = time.perf_counter()
    cute.compile(kernel, **args, options=f"--gpu-arch {arch}")
    return time.perf_counter() - start


def compile_mxfp8(
    config: Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    geometry: Geometry = DEFAULT_GEOMETRY,
    *,
    arch: str = "sm_100a",
) -> float:
    """Compile the mxfp8 kernel for `arch` with fake tensors; returns seconds."""
    _check_arch(arch)
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.typing import AddressSpace

    config.check_problem(
        hidden_size=geometry.hidden_size,
        intermediate_size=geometry.intermediate_size,
        top_k=geometry.top_k,
        num_experts=geometry.num_experts,
        world_size=geometry.world_size,
        max_tokens_per_rank=geometry.max_tokens_per_rank,
    )
    api = load_mxfp8_api()
    cm, cn, ck = mxfp8_args.CLUSTER_SHAPE_MNK
    clusters = BLACKWELL_SM_COUNT // (cm * cn * ck)
    kernel = api.kernel(
        **mxfp8_args.kernel_ctor_kwargs(
            config, geometry, api=api, ab_dtype=cutlass.Float8E4M3FN, max_active_clusters=clusters
        )
    )
    local_bytes, _ = kernel.get_workspace_sizes()

    def workspace(name: str) -> Any:
        if name == "local_workspace":  # static extent, as the launch path passes it
            return cute.runtime.make_fake_compact_tensor(
                cutlass.Uint8, (local_bytes,), memspace=AddressSpace.gmem, assumed_align=16
            )
        return cute.runtime.make_fake_compact_tensor(
            cutlass.Uint8, (cute.sym_int64(),), memspace=AddressSpace.gmem, assumed_align=16
        )

    args = mxfp8_args.call_args(
        geometry,
        tensor=_fake,
        workspace=workspace,
        peer_map=_peer_map(api.sym_buffer_host, geometry),
        stream=cuda.CUstream(0),
        max_active_clusters=clusters,
    )
    start = time.perf_counter()
    cute.compile(kernel, **args, options=f"--gpu-arch {arch}")
    return time.perf_counter() - start


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

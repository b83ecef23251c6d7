"""The MXFP4 x FP8 pull kernel's constructor arguments and tensor ABI, built from shapes in one
place (`common.pull_args` plus this format's; `common.pull_compile` makes the call arguments
from `tensor_specs`). Nothing here imports cutlass at module import time.

The tensor shapes follow the drop's ABI as read (`megamoe_kernel_fp8.__call__`,
`kernel_mxfp4_fp8_glu_fc12_swapab`: packed weights in an 8-bit shell with K halved, offsets
`uint8 [E, M/64, K/128, 16, 16]`, the per-token scale on a 16-byte row); they compile
(`compile.py`), which does not prove them right: that is for the GPU test, never run.
"""

from __future__ import annotations

from typing import Any

from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
from moe_ep_sm90.common.pull_args import pull_ctor_kwargs
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.config import (
    MXFP4_K_TILE,
    Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.layout import SCALE_WIRE_COLS
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.upstream import Mxfp4KernelApi

__all__ = ["build_kernel", "kernel_ctor_kwargs", "tensor_specs"]

_FOLD_M = 64  # weight rows per offset fold block (the drop's MXFP4_FOLD_M)
_FOLD_BYTES = 16  # a fold block is 16 x 16 bytes


def tensor_specs(g: LaunchGeometry) -> tuple[ArgSpec, ...]:
    """Every tensor argument of the kernel's `__call__`, in call order.

    Weights: packed e2m1 K-major views `fc1_weight [E, H/2, 2I]`, `fc2_weight [E, I/2, H]`
    (stride 1 on dim 1); offsets `[E, N/64, K/128, 16, 16]`; the per-expert residual in the
    weight dequant-scale slots; the activation dequant scales unused (ones).
    """
    t, k, e = g.max_tokens_per_rank, g.top_k, g.experts_per_rank
    h, i = g.hidden_size, g.intermediate_size

    def offsets(name: str, n: int, kk: int) -> ArgSpec:
        shape = (e, n // _FOLD_M, kk // MXFP4_K_TILE, _FOLD_BYTES, _FOLD_BYTES)
        return ArgSpec(name, shape, "uint8", 4)

    return (
        ArgSpec("activation", (t, h), "float8_e4m3fn", 1),
        ArgSpec("activation_sf", (t, SCALE_WIRE_COLS), "float32", 1),
        ArgSpec("topk_idx", (t, k), "int64", 1),
        ArgSpec("topk_weights", (t, k), "float32", 1),
        ArgSpec("fc1_weight", (e, h // 2, 2 * i), "uint8", 1),
        offsets("fc1_weight_sf", 2 * i, h),
        ArgSpec("fc1_activation_dequant_scale", (1,), "float32", 0, 4),
        ArgSpec("fc1_weight_dequant_scale", (e,), "float32", 0, 4),
        ArgSpec("fc2_weight", (e, i // 2, h), "uint8", 1),
        offsets("fc2_weight_sf", h, i),
        ArgSpec("fc2_activation_dequant_scale", (1,), "float32", 0, 4),
        ArgSpec("fc2_weight_dequant_scale", (e,), "float32", 0, 4),
        ArgSpec("output_activation", (t, h), "bfloat16", 1),
    )


def kernel_ctor_kwargs(
    config: Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
    g: LaunchGeometry,
    *,
    api: Mxfp4KernelApi,
    max_active_clusters: int,
) -> dict[str, Any]:
    """The shared pull arguments (`common.pull_args.pull_ctor_kwargs`) and the fixed
    contract's; `ab_dtype` is not passed (the MXFP4 class fixes e4m3 itself)."""
    shared = pull_ctor_kwargs(config, g, ab_dtype=None, max_active_clusters=max_active_clusters)
    del shared["ab_dtype"]
    return dict(
        **shared,
        sf_padding_block=api.sf_padding_block,
        sf_vec_size=api.e8m0_sf_vec_size,
        fp8_scale_mode=config.fp8_scale_mode,
        fp8_accum_mode="1xacc",
        dedup_dispatch=False,
        grouped_token_back=False,
        combine_format=config.combine_format,
    )


def build_kernel(
    config: Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig, g: LaunchGeometry, api: Mxfp4KernelApi
) -> tuple[Any, int]:
    """(the drop's kernel, its max active clusters) for `config` and `g`."""
    clusters = config.resolved_max_active_clusters
    kernel = api.swap_ab_kernel(
        **kernel_ctor_kwargs(config, g, api=api, max_active_clusters=clusters)
    )
    return kernel, clusters

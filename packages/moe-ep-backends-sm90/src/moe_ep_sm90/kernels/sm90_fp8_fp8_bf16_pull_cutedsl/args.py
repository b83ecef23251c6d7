"""The pull kernel's constructor and tensor arguments, built from shapes in one place.

`build_kernel` and `tensor_specs` (with `common.pull_args.pull_call_args`) are used by both
the GPU launch path (real tensors through `from_dlpack`) and the compile-only check (fake
gmem tensors), so the two cannot drift apart when the drop changes. Nothing here imports
cutlass at module import time.
"""

from __future__ import annotations

from typing import Any

from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
from moe_ep_sm90.common.config import FP8_BLOCK
from moe_ep_sm90.common.pull_args import pull_ctor_kwargs
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.upstream import PullKernelApi

__all__ = ["build_kernel", "kernel_ctor_kwargs", "tensor_specs"]


def tensor_specs(g: LaunchGeometry) -> tuple[ArgSpec, ...]:
    """Every tensor argument of the kernel's `__call__`, in call order (blockwise fp8).

    Weights are K-major views: `fc1_weight [E_local, H, 2I]` and `fc2_weight [E_local, I, H]`
    with stride 1 on dim 1. The four per-tensor dequant scales are unused in blockwise mode
    but part of the ABI (ones).
    """
    t, k, e = g.max_tokens_per_rank, g.top_k, g.experts_per_rank
    h, i = g.hidden_size, g.intermediate_size
    sf_cols = -(-(h // FP8_BLOCK) // 4) * 4
    return (
        ArgSpec("activation", (t, h), "float8_e4m3fn", 1),
        ArgSpec("activation_sf", (t, sf_cols), "float32", 1),
        ArgSpec("topk_idx", (t, k), "int64", 1),
        ArgSpec("topk_weights", (t, k), "float32", 1),
        ArgSpec("fc1_weight", (e, h, 2 * i), "float8_e4m3fn", 1),
        ArgSpec("fc1_weight_sf", (e, 2 * i // FP8_BLOCK, h // FP8_BLOCK), "float32", 2),
        ArgSpec("fc1_activation_dequant_scale", (1,), "float32", 0, 4),
        ArgSpec("fc1_weight_dequant_scale", (e,), "float32", 0, 4),
        ArgSpec("fc2_weight", (e, i, h), "float8_e4m3fn", 1),
        ArgSpec("fc2_weight_sf", (e, h // FP8_BLOCK, i // FP8_BLOCK), "float32", 2),
        ArgSpec("fc2_activation_dequant_scale", (1,), "float32", 0, 4),
        ArgSpec("fc2_weight_dequant_scale", (e,), "float32", 0, 4),
        ArgSpec("output_activation", (t, h), "bfloat16", 1),
    )


def kernel_ctor_kwargs(
    config: Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
    g: LaunchGeometry,
    *,
    api: PullKernelApi,
    ab_dtype: Any,
    max_active_clusters: int,
) -> dict[str, Any]:
    """Constructor keyword arguments of the drop's kernel class for this config and geometry.

    The shared ones (`common.pull_args.pull_ctor_kwargs`), then this format's: blockwise
    scales, bf16 combine, no dispatch dedup.
    """
    return dict(
        **pull_ctor_kwargs(config, g, ab_dtype=ab_dtype, max_active_clusters=max_active_clusters),
        sf_padding_block=api.sf_padding_block,
        sf_vec_size=api.e8m0_sf_vec_size,
        fp8_scale_mode="blockwise",
        fp8_accum_mode=config.accum_mode,
        dedup_dispatch=False,
        grouped_token_back=False,
        combine_format="bf16",
        compact_pull_buffer=True,
    )


def kernel_class(config: Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig, api: PullKernelApi) -> type:
    """The drop's kernel class for the configured layout."""
    return api.swap_ab_kernel if config.swap_ab else api.native_kernel


def build_kernel(
    config: Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig, g: LaunchGeometry, api: PullKernelApi
) -> tuple[Any, int]:
    """(the drop's kernel, its max active clusters: the config's) for `config` and `g`: the
    one builder of the launch and the compile-only check."""
    import cutlass

    clusters = config.resolved_max_active_clusters
    kernel = kernel_class(config, api)(
        **kernel_ctor_kwargs(
            config, g, api=api, ab_dtype=cutlass.Float8E4M3FN, max_active_clusters=clusters
        )
    )
    return kernel, clusters

"""The pull kernel's constructor and call arguments, built from shapes in one place.

`kernel_ctor_kwargs` and `call_args` are used by both the GPU launch path (real tensors
through `from_dlpack`) and the compile-only check (fake gmem tensors), so the two cannot
drift apart when the drop changes. Nothing here imports cutlass at module import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, kernel_call_args
from moe_ep_sm90.common.config import FP8_BLOCK
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.upstream import PullKernelApi

__all__ = [
    "build_kernel",
    "call_args",
    "kernel_ctor_kwargs",
    "tensor_specs",
]


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

    Fixed choices (not knobs of our config): blockwise scales, top-k weights applied in FC1
    (the DeepGEMM compute graph), bf16 combine, token-back by the epilogue warps.
    """
    return dict(
        mma_tiler_mnk=config.mma_tiler_mnk,
        cluster_shape_mnk=config.cluster_shape_mnk,
        use_2cta_instrs=False,
        group_hint=max_active_clusters,
        token_padding_block=config.token_padding_block,
        sf_padding_block=api.sf_padding_block,
        load_balance_mode=config.load_balance_mode,
        static_expert_shape=(g.experts_per_rank, 2 * g.intermediate_size, g.hidden_size),
        force_static_sched=True,
        clc_bundle_size=None,
        num_sched_stages=None,
        ab_dtype=ab_dtype,
        sf_vec_size=api.e8m0_sf_vec_size,
        fp8_scale_mode="blockwise",
        fp8_accum_mode=config.accum_mode,
        pingpong=False,
        world_size=g.world_size,
        local_rank=g.rank,
        num_topk=g.top_k,
        max_tokens_per_rank=g.max_tokens_per_rank,
        hidden=g.hidden_size,
        fc2_in_kernel_topk_reduce=False,
        apply_topk_in_fc1=True,
        token_back_mode="epi_warps",
        epi_flag_batch=(2, 4),
        flag_batch=1,
        gate_up_clamp=config.gate_up_clamp,
        dedup_dispatch=False,
        grouped_token_back=False,
        combine_format="bf16",
        active_dispatch_warps=1,
        compact_pull_buffer=True,
        fc1_store_offload=True,
        fc1_early_done_publish=False,
        fold_producer_warps=True,
        generate_c=False,
        tail_split_pairs=False,
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


def call_args(
    g: LaunchGeometry,
    *,
    tensor: Callable[[ArgSpec], Any],
    pointer: Callable[[str], Any],
    peer_map: Any,
    stream: Any,
    max_active_clusters: int,
) -> dict[str, Any]:
    """Keyword arguments of the kernel's `__call__` (and of `cute.compile`).

    Args:
        tensor: builds the cute tensor for one `ArgSpec` (real: from_dlpack of the staged
            buffer; compile-only: a fake gmem tensor of that shape).
        pointer: builds the uint8 gmem pointer of `"local_workspace"` / `"shared_workspace"`.
        peer_map: the drop's `SymBufferHost` for the symmetric workspace.
        stream: a `cuda.CUstream`.
    """
    return kernel_call_args(
        tensor_specs(g),
        tensor,
        workspaces=(pointer("local_workspace"), pointer("shared_workspace")),
        peer_map=peer_map,
        stream=stream,
        max_active_clusters=max_active_clusters,
        extra={"fc1_c": None},
    )

"""The nvfp4 kernel's constructor and call arguments, built from shapes in one place.

Used by the compile-only check (fake gmem tensors) and meant for the launch path (real
tensors through `from_dlpack`), so the two cannot drift apart. No cutlass import here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, ceil_to, kernel_call_args
from moe_ep_sm100.common.cutedsl import shared_ctor_kwargs
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.config import (
    Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.upstream import Nvfp4KernelApi

__all__ = [
    "NVFP4_BLOCK",
    "build_kernel",
    "call_args",
    "kernel_ctor_kwargs",
    "tensor_specs",
]

NVFP4_BLOCK = 16
# Fixed launch geometry (the drop driver's defaults): swap-AB tile, 1-CTA cluster.
MMA_TILER_MNK = (128, 128, 256)
CLUSTER_SHAPE_MNK = (1, 1, 1)


def tensor_specs(g: LaunchGeometry) -> tuple[ArgSpec, ...]:
    """Every tensor argument of the kernel's `__call__`, in call order.

    Weights are K-major: `fc1_weight [E_local, H, 2I]`, `fc2_weight [E_local, I, H]` (stride 1
    on dim 1); weight scale planes are 128x4-swizzled per expert and flattened
    (`[E_local, ceil128(N) * ceil4(K/16)]`); `fc1_alpha` / `fc2_alpha` / `fc1_norm_const` are
    per-expert fp32 global-scale factors.
    """
    t, k, e = g.max_tokens_per_rank, g.top_k, g.experts_per_rank
    h, i = g.hidden_size, g.intermediate_size
    sf = NVFP4_BLOCK
    return (
        ArgSpec("activation", (t, h), "fp4", 1),
        ArgSpec("activation_sf", (t, ceil_to(h // sf, 4)), "fp8_e4m3", 1),
        ArgSpec("topk_idx", (t, k), "int64", 1),
        ArgSpec("topk_weights", (t, k), "float32", 1),
        ArgSpec("fc1_weight", (e, h, 2 * i), "fp4", 1),
        ArgSpec("fc1_weight_sf", (e, ceil_to(2 * i, 128) * ceil_to(h // sf, 4)), "fp8_e4m3", 1),
        ArgSpec("fc2_weight", (e, i, h), "fp4", 1),
        ArgSpec("fc2_weight_sf", (e, ceil_to(h, 128) * ceil_to(i // sf, 4)), "fp8_e4m3", 1),
        ArgSpec("fc1_alpha", (e,), "float32", 0, 4),
        ArgSpec("fc2_alpha", (e,), "float32", 0, 4),
        ArgSpec("fc1_norm_const", (e,), "float32", 0, 4),
        ArgSpec("output_activation", (t, h), "bfloat16", 1),
    )


def kernel_ctor_kwargs(
    config: Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    g: LaunchGeometry,
    *,
    api: Nvfp4KernelApi,
    fc2_output_dtype: Any,
    max_active_clusters: int,
) -> dict[str, Any]:
    """Constructor keyword arguments of the drop's `Sm100MegaMoEKernel`.

    Fixed choices: SwiGLU, top-k weights applied in FC1, bf16 combine, token-back by the
    epilogue warps, the standalone top-k reduce.
    """
    return dict(
        **shared_ctor_kwargs(
            config,
            g,
            api=api,
            mma_tiler_mnk=MMA_TILER_MNK,
            cluster_shape_mnk=CLUSTER_SHAPE_MNK,
            use_2cta_instrs=False,
            max_active_clusters=max_active_clusters,
        ),
        fc2_output_dtype=fc2_output_dtype,
        non_ubulk_fc2_store=True,
        in_kernel_fc2_reduce=False,
        skip_topk_reduce=False,
        topk_reduce_persistent=False,
        enable_fc1_activation_per_token_scale=False,
        apply_topk_in_fc1=True,
        swiglu_alpha=None,
        swiglu_beta=None,
        situ_beta=None,
        situ_linear_beta=None,
        combine_format=api.combine_format_bf16,
    )


def build_kernel(
    config: Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    g: LaunchGeometry,
    api: Nvfp4KernelApi,
    *,
    sm_count: int | None = None,
) -> tuple[Any, int]:
    """(the drop's kernel, its max active clusters) for `config` and `g`: the one builder
    of the launch and the compile-only check (`sm_count` there: no GPU to ask)."""
    import cutlass

    from moe_ep.backends.support.cutedsl.mega_kernel import max_active_clusters

    clusters = max_active_clusters(CLUSTER_SHAPE_MNK, sm_count=sm_count)
    kwargs = kernel_ctor_kwargs(
        config, g, api=api, fc2_output_dtype=cutlass.BFloat16, max_active_clusters=clusters
    )
    return api.kernel(**kwargs), clusters


def call_args(
    g: LaunchGeometry,
    *,
    tensor: Callable[[ArgSpec], Any],
    pointer: Callable[[str], Any],
    peer_map: Any,
    stream: Any,
    max_active_clusters: int,
) -> dict[str, Any]:
    """Keyword arguments of the kernel's `__call__` (and of `cute.compile`)."""
    return kernel_call_args(
        tensor_specs(g),
        tensor,
        workspaces=(pointer("local_workspace"), pointer("shared_workspace")),
        peer_map=peer_map,
        stream=stream,
        max_active_clusters=max_active_clusters,
        # off, as constructed: no per-token FC1 scale, the non-persistent top-k reduce
        extra={"fc1_activation_per_token_scale": None, "num_valid_tokens": None},
    )

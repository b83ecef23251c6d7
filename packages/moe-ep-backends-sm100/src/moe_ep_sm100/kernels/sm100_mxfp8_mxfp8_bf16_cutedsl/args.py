"""The mxfp8 kernel's constructor and call arguments, built from shapes in one place.

Differences from the nvfp4 kernel's `args`: e4m3 payloads with
one E8M0 scale per 32 elements, a 2-CTA MMA (tile (256, 256, 128), cluster (2, 1, 1)), and
the workspaces are passed as uint8 tensors (the local one with a static extent).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, ceil_to, kernel_call_args
from moe_ep_sm100.common.cutedsl import shared_ctor_kwargs
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.config import (
    MXFP8_BLOCK,
    Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.upstream import Mxfp8KernelApi

__all__ = [
    "CLUSTER_SHAPE_MNK",
    "build_kernel",
    "call_args",
    "col_quant_specs",
    "kernel_ctor_kwargs",
    "tensor_specs",
]

MMA_TILER_MNK = (256, 256, 128)
CLUSTER_SHAPE_MNK = (2, 1, 1)


def tensor_specs(g: LaunchGeometry) -> tuple[ArgSpec, ...]:
    """Tensor arguments of the kernel's `__call__` except the workspaces, in call order.

    `dtype` "fp8_e4m3" payloads, "e8m0" scales. Weights are K-major `[E_local, H, 2I]` /
    `[E_local, I, H]`; weight scale planes 128x4-swizzled per expert and flattened.
    """
    t, k, e = g.max_tokens_per_rank, g.top_k, g.experts_per_rank
    h, i = g.hidden_size, g.intermediate_size
    sf = MXFP8_BLOCK
    return (
        ArgSpec("activation", (t, h), "fp8_e4m3", 1),
        ArgSpec("activation_sf", (t, ceil_to(-(-h // sf), 4)), "e8m0", 1),
        ArgSpec("topk_idx", (t, k), "int64", 1),
        ArgSpec("topk_weights", (t, k), "float32", 1),
        ArgSpec("fc1_weight", (e, h, 2 * i), "fp8_e4m3", 1),
        ArgSpec("fc1_weight_sf", (e, ceil_to(2 * i, 128) * ceil_to(h // sf, 4)), "e8m0", 1),
        ArgSpec("fc2_weight", (e, i, h), "fp8_e4m3", 1),
        ArgSpec("fc2_weight_sf", (e, ceil_to(h, 128) * ceil_to(i // sf, 4)), "e8m0", 1),
        ArgSpec("output_activation", (t, h), "bfloat16", 1),
    )


def col_quant_specs(pool_token_capacity: int, g: LaunchGeometry) -> tuple[ArgSpec, ...]:
    """The outputs of the drop kernel's token-axis requant (`Mxfp8ColRequant`, which runs
    after the combine on every launch since flashinfer-python 0.7.4): `col_quant_data
    [pool, H]` fp8 and `col_quant_sf [H * pool / 32]` E8M0 bytes, `pool` the kernel's
    `pool_token_capacity` (its runner's sizes). moe-ep reads neither."""
    h = g.hidden_size
    return (
        ArgSpec("col_quant_data", (pool_token_capacity, h), "fp8_e4m3", 1),
        ArgSpec("col_quant_sf", (h * pool_token_capacity // MXFP8_BLOCK,), "uint8", 0),
    )


def kernel_ctor_kwargs(
    config: Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    g: LaunchGeometry,
    *,
    api: Mxfp8KernelApi,
    ab_dtype: Any,
    max_active_clusters: int,
) -> dict[str, Any]:
    """Constructor keyword arguments of the drop's `Sm100MegaMoEMxfp8Kernel`."""
    return dict(
        **shared_ctor_kwargs(
            config,
            g,
            api=api,
            mma_tiler_mnk=MMA_TILER_MNK,
            cluster_shape_mnk=CLUSTER_SHAPE_MNK,
            use_2cta_instrs=True,
            max_active_clusters=max_active_clusters,
        ),
        ab_dtype=ab_dtype,
        sf_vec_size=MXFP8_BLOCK,
        local_rank=g.rank,
        fc2_in_kernel_topk_reduce=False,
        skip_topk_reduce=False,
        topk_reduce_persistent=False,
    )


def build_kernel(
    config: Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    g: LaunchGeometry,
    api: Mxfp8KernelApi,
    *,
    sm_count: int | None = None,
) -> tuple[Any, int]:
    """(the drop's kernel, its max active clusters) for `config` and `g`: the one builder
    of the launch and the compile-only check (`sm_count` there: no GPU to ask)."""
    import cutlass

    from moe_ep.backends.support.cutedsl.mega_kernel import max_active_clusters

    clusters = max_active_clusters(CLUSTER_SHAPE_MNK, sm_count=sm_count)
    kwargs = kernel_ctor_kwargs(
        config, g, api=api, ab_dtype=cutlass.Float8E4M3FN, max_active_clusters=clusters
    )
    return api.kernel(**kwargs), clusters


def call_args(
    g: LaunchGeometry,
    *,
    pool_token_capacity: int,
    tensor: Callable[[ArgSpec], Any],
    workspace: Callable[[str], Any],
    peer_map: Any,
    stream: Any,
    max_active_clusters: int,
) -> dict[str, Any]:
    """Keyword arguments of the kernel's `__call__` (and of `cute.compile`).

    `workspace(name)` builds the uint8 tensor of `"local_workspace"` (static extent) or
    `"shared_workspace"`; `pool_token_capacity` is the built kernel's (`col_quant_specs`).
    """
    return kernel_call_args(
        (*tensor_specs(g), *col_quant_specs(pool_token_capacity, g)),
        tensor,
        workspaces=(workspace("local_workspace"), workspace("shared_workspace")),
        peer_map=peer_map,
        stream=stream,
        max_active_clusters=max_active_clusters,
        extra={"fc1_c": None, "num_valid_tokens": None},
    )

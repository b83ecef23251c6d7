"""The kernel's descriptors and call arguments, built from shapes in one place (the launch
and the compile-only check both use them, so they cannot drift apart).

The drop's kernel takes a `ProblemDesc` (geometry, quantization kind, routing) and an
`ImplDesc` (tiles, cluster, scheduling) at construction; its `__call__` takes the staged
inputs, the four weight tensors, the output, two raw 128-byte aligned workspace pointers,
the peer-pointer map and the stream. Fixed choices: swap-AB with a 2-CTA MMA (tile
(256, 128, 128), cluster (2, 1), instruction K 32 of `kind::mxf8f6f4`), static grouped
scheduling over one launch of `max active clusters`, token-back by the epilogue warps, the
combine (`config.combine_dtype`: bf16) reduced by the kernel's separate top-k reduce, routing
weights applied before FC2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, ceil_to
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
    MX_BLOCK,
    Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig,
    padded_tokens_per_rank,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.layout import activation_sf_columns
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.upstream import (
    QUANT_KIND,
    Mxfp4KernelApi,
)

__all__ = [
    "CLUSTER_SHAPE_MN",
    "KERNEL_ARG_NAMES",
    "MMA_TILER_MNK",
    "WORKSPACE_ALIGN",
    "build_kernel",
    "call_args",
    "impl_desc_fields",
    "problem_desc_fields",
    "staged_tokens",
    "tensor_specs",
    "workspace_pointer",
]

MMA_TILER_MNK = (256, 128, 128)
CLUSTER_SHAPE_MN = (2, 1)
_INSTRUCTION_K = 32  # kind::mxf8f6f4 (a mixed-width pair): quant_def.QuantKind.instruction_k
TOKEN_PADDING_BLOCK = 64
SF_PADDING_BLOCK = 128
WORKSPACE_ALIGN = 128
"""The kernel's workspace regions assume 128-byte aligned bases (its `aot_compile` ABI)."""

KERNEL_ARG_NAMES = {"topk_idx": "topk_indices", "topk_weights": "topk_scores"}
"""Spec names (core's staging names) the drop's `__call__` spells differently."""


def staged_tokens(g: LaunchGeometry) -> int:
    """Rows of the staging buffers and of the kernel's token axis (`padded_tokens_per_rank`)."""
    return padded_tokens_per_rank(g.max_tokens_per_rank, g.top_k)


def tensor_specs(g: LaunchGeometry) -> tuple[ArgSpec, ...]:
    """Tensor arguments of the kernel's `__call__`, in call order (core's staging names).

    Weights are K-major e2m1 `[E_local, H, 2I]` / `[E_local, I, H]` (logical elements; packed
    two per byte along H / I); weight scale planes 128x4-swizzled per expert and flattened;
    the activation scales linear `[T, ceil16(H/32)]`.
    """
    t, k, e = staged_tokens(g), g.top_k, g.experts_per_rank
    h, i = g.hidden_size, g.intermediate_size
    return (
        ArgSpec("activation", (t, h), "fp8_e4m3", 1),
        ArgSpec("activation_sf", (t, activation_sf_columns(h)), "e8m0", 1),
        ArgSpec("topk_idx", (t, k), "int32", 1),
        ArgSpec("topk_weights", (t, k), "float32", 1, align=4),
        ArgSpec("fc1_weight", (e, h, 2 * i), "fp4", 1),
        ArgSpec("fc1_weight_sf", (e, ceil_to(2 * i, 128) * ceil_to(h // MX_BLOCK, 4)), "e8m0", 1),
        ArgSpec("fc2_weight", (e, i, h), "fp4", 1),
        ArgSpec("fc2_weight_sf", (e, ceil_to(h, 128) * ceil_to(i // MX_BLOCK, 4)), "e8m0", 1),
        ArgSpec("output_activation", (t, h), "bfloat16", 1),
    )


def problem_desc_fields(
    config: Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig, g: LaunchGeometry, api: Mxfp4KernelApi
) -> dict[str, Any]:
    """The kernel's `ProblemDesc` fields (global expert count; the kernel slices per rank)."""
    import cutlass

    return {
        "expert_count": g.num_experts,
        "intermediate_gateup_size": 2 * g.intermediate_size,
        "hidden_size": g.hidden_size,
        "quant_kind": QUANT_KIND,
        "a_major_mode": api.operand_major_k,
        "b_major_mode": api.operand_major_k,
        "combine_format": api.combine_format(config.combine_dtype),
        "gate_up_clamp": config.gate_up_clamp,
        "situ_beta": None,
        "situ_linear_beta": None,
        "swiglu_alpha": None,
        "swiglu_beta": None,
        "world_size": g.world_size,
        "topk": g.top_k,
        "topk_index_dtype": cutlass.Int32,
        "max_tokens_per_rank": staged_tokens(g),
        "apply_topk_at_fc1": True,
        "fc1_activation_per_token_scale": False,
    }


def impl_desc_fields(launch_cluster_count: int) -> dict[str, Any]:
    """The kernel's `ImplDesc` fields for `launch_cluster_count` co-resident clusters."""
    return {
        "architecture": "sm_100",
        "mma_instruction_mnk": (MMA_TILER_MNK[0], MMA_TILER_MNK[1], _INSTRUCTION_K),
        "mma_tiler_mnk": MMA_TILER_MNK,
        "mma_k_mode": "1x",
        "cluster_shape_mn": CLUSTER_SHAPE_MN,
        "use_2cta_instrs": True,
        "schedule_policy": ("grouped", None),
        "token_padding_block": TOKEN_PADDING_BLOCK,
        "sf_padding_block": SF_PADDING_BLOCK,
        "work_id_mode": "grid_stride",
        "fc2_use_bulk": False,
        "epi_flag_batches": (4, 2),
        "launch_cluster_count": launch_cluster_count,
        "token_in_flag_batch": 1,
        "token_back_mode": "epi_warps",
        "reduce_topk_in_kernel": False,
        "skip_topk_reduce": False,
        "topk_reduce_persistent": False,
    }


def build_kernel(
    config: Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig,
    g: LaunchGeometry,
    api: Mxfp4KernelApi,
    *,
    sm_count: int | None = None,
) -> tuple[Any, int]:
    """(the drop's kernel, its launch cluster count) for `config` and `g`: the one builder
    of the launch and the compile-only check (`sm_count` there: no GPU to ask).

    Raises `RuntimeError` if the built kernel's activation-scale columns differ from the
    staging's (`layout.activation_sf_columns`).
    """
    from moe_ep.backends.support.cutedsl.mega_kernel import max_active_clusters

    clusters = max_active_clusters((*CLUSTER_SHAPE_MN, 1), sm_count=sm_count)
    kernel = api.kernel(
        api.problem_desc(problem_desc_fields(config, g, api)),
        api.impl_desc(impl_desc_fields(clusters)),
    )
    cols = int(kernel.token_comm.activation_sf_hidden_padded)
    if cols != activation_sf_columns(g.hidden_size):
        raise RuntimeError(
            f"the drop's kernel stages {cols} activation-scale columns for H={g.hidden_size}; "
            f"moe_ep_sm100 stages {activation_sf_columns(g.hidden_size)}"
        )
    return kernel, clusters


def workspace_pointer(address: int) -> Any:
    """A raw gmem `Uint8` workspace pointer at `address`, promised 128-byte aligned
    (`RuntimeError` if it is not)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.typing import AddressSpace

    if address % WORKSPACE_ALIGN:
        raise RuntimeError(f"workspace address {address:#x} is not {WORKSPACE_ALIGN}-byte aligned")
    return cute.runtime.make_ptr(
        cutlass.Uint8, address, AddressSpace.gmem, assumed_align=WORKSPACE_ALIGN
    )


def call_args(
    g: LaunchGeometry,
    *,
    tensor: Callable[[ArgSpec], Any],
    workspaces: tuple[int, int],
    peer_map: Any,
    stream: Any,
) -> dict[str, Any]:
    """Keyword arguments of the kernel's `__call__` (and of `cute.compile`): `tensor(spec)`
    for every spec under the kernel's names, the (local, shared) workspace addresses as
    pointers, the peer map and the stream."""
    args = {KERNEL_ARG_NAMES.get(s.name, s.name): tensor(s) for s in tensor_specs(g)}
    args["local_workspace"] = workspace_pointer(workspaces[0])
    args["shared_workspace"] = workspace_pointer(workspaces[1])
    args["peer_rank_ptr_mapper_host"] = peer_map
    args["stream"] = stream
    return args

"""The constructor and call arguments both sm90 pull kernels' drop classes take alike
(`moe_hopper_fp8` / `moe_hopper_bf16` share their fused FC1+FC2 and token-comm bases).

Each kernel's `args` module adds its format's own constructor arguments and lists its
tensor arguments; the launch path and the compile-only check build through it, so the two
cannot drift apart. Nothing here imports cutlass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, kernel_call_args
from moe_ep_sm90.common.pull_tiles import PullTileConfig

__all__ = ["pull_call_args", "pull_ctor_kwargs"]


def pull_ctor_kwargs(
    config: PullTileConfig, g: LaunchGeometry, *, ab_dtype: Any, max_active_clusters: int
) -> dict[str, Any]:
    """The constructor keyword arguments the two pull kernel classes share.

    Fixed choices (not knobs of our configs): static scheduling over a static expert shape,
    no ping-pong, top-k weights applied in FC1 (the DeepGEMM compute graph), a separate
    top-k reduce over the bf16 combine cells, token-back by the epilogue warps, one active
    dispatch warp with the producer warps folded into it, no `generate_c` output, no
    tail-split pairs.
    """
    return dict(
        mma_tiler_mnk=config.mma_tiler_mnk,
        cluster_shape_mnk=config.cluster_shape_mnk,
        use_2cta_instrs=False,
        group_hint=max_active_clusters,
        token_padding_block=config.token_padding_block,
        load_balance_mode=config.load_balance_mode,
        static_expert_shape=(g.experts_per_rank, 2 * g.intermediate_size, g.hidden_size),
        force_static_sched=True,
        clc_bundle_size=None,
        num_sched_stages=None,
        ab_dtype=ab_dtype,
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
        active_dispatch_warps=1,
        fc1_store_offload=True,
        fc1_early_done_publish=False,
        fold_producer_warps=True,
        generate_c=False,
        tail_split_pairs=False,
    )


def pull_call_args(
    specs: Iterable[ArgSpec],
    *,
    tensor: Callable[[ArgSpec], Any],
    pointer: Callable[[str], Any],
    peer_map: Any,
    stream: Any,
    max_active_clusters: int,
) -> dict[str, Any]:
    """Keyword arguments of a pull kernel's `__call__` (and of `cute.compile`).

    Args:
        specs: the kernel's tensor arguments (its `args.tensor_specs`).
        tensor: builds the cute tensor for one `ArgSpec` (real: from_dlpack of the staged
            buffer; compile-only: a fake gmem tensor of that shape).
        pointer: builds the uint8 gmem pointer of `"local_workspace"` / `"shared_workspace"`.
        peer_map: the drop's `SymBufferHost` for the symmetric workspace.
        stream: a `cuda.CUstream`.
    """
    return kernel_call_args(
        specs,
        tensor,
        workspaces=(pointer("local_workspace"), pointer("shared_workspace")),
        peer_map=peer_map,
        stream=stream,
        max_active_clusters=max_active_clusters,
        extra={"fc1_c": None},  # generate_c=False: never referenced
    )

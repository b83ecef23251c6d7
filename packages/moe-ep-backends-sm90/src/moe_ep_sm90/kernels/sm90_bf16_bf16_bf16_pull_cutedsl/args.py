"""The bf16 pull kernel's constructor and call arguments, built from shapes in one place
(used by the GPU launch path and the compile-only check alike). Nothing here imports
cutlass at module import time."""

from __future__ import annotations

from typing import Any

from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
from moe_ep_sm90.common.pull_args import pull_ctor_kwargs
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.config import (
    Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.upstream import Bf16PullKernelApi

__all__ = ["build_kernel", "tensor_specs"]


def tensor_specs(g: LaunchGeometry) -> tuple[ArgSpec, ...]:
    """Every tensor argument of the kernel's `__call__` (`fc1_c` aside: None, `generate_c`
    off). Weights are K-major views `fc1_weight [E_local, H, 2I]` and
    `fc2_weight [E_local, I, H]` (stride 1 on dim 1); no scale planes."""
    t, k, e = g.max_tokens_per_rank, g.top_k, g.experts_per_rank
    h, i = g.hidden_size, g.intermediate_size
    return (
        ArgSpec("activation", (t, h), "bfloat16", 1),
        ArgSpec("topk_idx", (t, k), "int64", 1),
        ArgSpec("topk_weights", (t, k), "float32", 1),
        ArgSpec("fc1_weight", (e, h, 2 * i), "bfloat16", 1),
        ArgSpec("fc2_weight", (e, i, h), "bfloat16", 1),
        ArgSpec("output_activation", (t, h), "bfloat16", 1),
    )


def build_kernel(
    config: Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig,
    g: LaunchGeometry,
    api: Bf16PullKernelApi,
) -> tuple[Any, int]:
    """(the drop's kernel, its max active clusters: the config's) for `config` and `g`: the
    one builder of the launch and the compile-only check. The constructor takes exactly the
    arguments both pull kernels share (`common.pull_args.pull_ctor_kwargs`): the bf16
    kernel has no scale or combine-format arguments (its SF padding mirrors the token
    padding, its combine is bf16)."""
    import cutlass

    clusters = config.resolved_max_active_clusters
    cls = api.swap_ab_kernel if config.swap_ab else api.native_kernel
    kernel = cls(
        **pull_ctor_kwargs(config, g, ab_dtype=cutlass.BFloat16, max_active_clusters=clusters)
    )
    return kernel, clusters

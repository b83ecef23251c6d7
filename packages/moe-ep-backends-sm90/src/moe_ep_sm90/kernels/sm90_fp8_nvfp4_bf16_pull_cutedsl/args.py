"""The NVFP4 x FP8 pull kernel's constructor arguments and tensor ABI: the MXFP4 kernel's
(`sm90_fp8_mxfp4_bf16_pull_cutedsl.args`, whose class the NVFP4 one extends) with the NVFP4
scale planes and the two NVFP4 constructor arguments. Nothing here imports cutlass at module
import time.

Tensor ABI as read (`nvfp4_kernels.py`, FlashInfer's `weights.py` launch checks): packed
e2m1 K-major `fc1_weight [E, H/2, 2I]`, `fc2_weight [E, I/2, H]`; folded K16 e4m3 scale bytes
`uint8 [E, N/64, K/128, 32, 16]`; `fc{1,2}_weight_dequant_scale [E]` the per-expert decode
scale times 8; `fc{1,2}_activation_dequant_scale [1]` a placeholder 1. They compile
(`compile.py`), which does not prove them right: that is for the GPU test, never run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl import args as mxfp4_args
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.upstream import Nvfp4KernelApi

__all__ = ["SCALE_FOLD_SHAPE", "build_kernel", "kernel_ctor_kwargs", "tensor_specs"]

SCALE_FOLD_SHAPE = (32, 16)
"""Bytes of one folded 64-row x 128-K block of K16 scales (64 x 8 scales transposed in
pairs: the drop's `MXFP4_FOLD_BLOCK_BYTES = 512`, `_folded_scale_rows = 32`)."""
_FOLD_M, _FOLD_K = 64, 128


def tensor_specs(g: LaunchGeometry) -> tuple[ArgSpec, ...]:
    """Every tensor argument of the kernel's `__call__`, in call order (the MXFP4 kernel's,
    with the scale planes `[E, N/64, K/128, 32, 16]`)."""
    h, i = g.hidden_size, g.intermediate_size
    planes = {"fc1_weight_sf": (2 * i, h), "fc2_weight_sf": (h, i)}
    out = []
    for spec in mxfp4_args.tensor_specs(g):
        if spec.name in planes:
            n, k = planes[spec.name]
            spec = replace(
                spec, shape=(spec.shape[0], n // _FOLD_M, k // _FOLD_K, *SCALE_FOLD_SHAPE)
            )
        out.append(spec)
    return tuple(out)


def kernel_ctor_kwargs(
    config: Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig,
    g: LaunchGeometry,
    *,
    api: Nvfp4KernelApi,
    max_active_clusters: int,
) -> dict[str, Any]:
    """The MXFP4 kernel's arguments plus `nvfp4_fc1_k256_overlap` and the conversion layout
    of `config.nvfp4_kperm`."""
    kwargs = mxfp4_args.kernel_ctor_kwargs(
        config, g, api=api, max_active_clusters=max_active_clusters
    )
    kwargs["nvfp4_fc1_k256_overlap"] = config.nvfp4_fc1_k256_overlap
    kwargs["nvfp4_conversion"] = api.conversion(config.nvfp4_kperm)
    return kwargs


def build_kernel(
    config: Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig, g: LaunchGeometry, api: Nvfp4KernelApi
) -> tuple[Any, int]:
    """(the drop's kernel, its max active clusters) for `config` and `g`."""
    clusters = config.resolved_max_active_clusters
    kernel = api.swap_ab_kernel(
        **kernel_ctor_kwargs(config, g, api=api, max_active_clusters=clusters)
    )
    return kernel, clusters

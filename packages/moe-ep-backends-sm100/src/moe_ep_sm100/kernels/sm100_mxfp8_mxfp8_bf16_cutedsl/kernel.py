"""`sm100_mxfp8_mxfp8_bf16_cutedsl`: the Blackwell CuTe DSL mxfp8 mega-MoE (2-CTA) kernel.

Warning:
    NEVER RUN ON A GPU (no Blackwell machine was available); what is verified on CPU
    instead, for both sm100 CuTe DSL kernels, is listed in `moe_ep_sm100.common.cutedsl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moe_ep.backends.support.cutedsl.mega_kernel import StagedBuffers, storage_tensor
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
from moe_ep.errors import MoeEpUsageError
from moe_ep.registry import register_mega_kernel
from moe_ep_sm100.common.cutedsl import Sm100CutedslKernel
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl import args
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.layout import (
    Mxfp8Weights,
    prepare_mxfp8_weights,
    stage_mxfp8_inputs,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.upstream import load_mxfp8_api

if TYPE_CHECKING:
    from moe_ep.types import MoEEpTensors, MoEWeightPack

__all__ = ["MAX_TENSOR_EXTENT", "Sm100Mxfp8Mxfp8Bf16CutedslKernel"]

MAX_TENSOR_EXTENT = 2**31 - 1
"""Largest extent of a dynamic 32-bit tensor mode (bytes, for the uint8 shared workspace)."""


@register_mega_kernel("sm100_mxfp8_mxfp8_bf16_cutedsl", deprecated_aliases=("mxfp8_cutedsl",))
class Sm100Mxfp8Mxfp8Bf16CutedslKernel(Sm100CutedslKernel):
    """Fused dispatch + mxfp8 FC1 + SwiGLU + FC2 + combine (2-CTA MMA), NVSHMEM peers.

    Weights are quantized once (`prepare_mxfp8_weights`: E8M0 per 32 along K, gate/up
    interleaved by 32, K-major, 128x4-swizzled scales); activations per call.
    """

    payload_dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn
    config_cls: ClassVar[type[Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig]] = (
        Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig
    )
    _pool_token_capacity: int
    """The built drop kernel's dispatch pool rows (set by `_make_kernel`)."""

    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> Mxfp8Weights:
        w = weights.to(device)
        return prepare_mxfp8_weights(w.w13, w.w2, w.w13_scale, w.w2_scale)

    def _stage(self, tensors: MoEEpTensors, max_tokens: int) -> StagedBuffers:
        return stage_mxfp8_inputs(
            tensors.hidden_states, tensors.topk_ids, tensors.topk_weights, max_tokens=max_tokens
        )

    def _tensor_specs(self, g: LaunchGeometry) -> tuple[ArgSpec, ...]:
        return args.tensor_specs(g)

    def _check_workspace_sizes(
        self, g: LaunchGeometry, local_bytes: int, shared_bytes: int
    ) -> None:
        """The kernel takes its shared workspace as a uint8 tensor with a dynamic 32-bit
        extent (its runner too; the nvfp4 runner moved to raw pointers for this reason), so
        a workspace of 2**31 bytes or more would wrap: refused, naming a `max_tokens_per_rank`
        that fits (the workspace grows about linearly with it; the per-(token, slot) bf16
        combine cells dominate)."""
        if shared_bytes <= MAX_TENSOR_EXTENT:
            return
        fits = max(1, g.max_tokens_per_rank * MAX_TENSOR_EXTENT // shared_bytes - 1)
        raise MoeEpUsageError(
            f"{self.kernel_name}: the shared workspace for max_tokens_per_rank="
            f"{g.max_tokens_per_rank}, top_k={g.top_k}, hidden_size={g.hidden_size} is "
            f"{shared_bytes} bytes, but the kernel addresses it through a 32-bit extent (at "
            f"most {MAX_TENSOR_EXTENT} bytes); use max_tokens_per_rank <= about {fits}"
        )

    def _make_kernel(self, g: LaunchGeometry) -> tuple[Any, Any, int]:
        api = load_mxfp8_api()
        kernel, clusters = args.build_kernel(self.cfg, g, api)
        self._pool_token_capacity = int(kernel.pool_token_capacity)
        return kernel, api, clusters

    def _local_tensors(self, g: LaunchGeometry, device: torch.device) -> dict[str, torch.Tensor]:
        """The kernel's col-requant outputs (`args.col_quant_specs`): local, pooled with
        the compiled entry, written by every launch and never read."""

        def alloc(nbytes: int) -> torch.Tensor:
            return torch.empty((nbytes,), dtype=torch.uint8, device=device)

        specs = args.col_quant_specs(self._pool_token_capacity, g)
        return {s.name: storage_tensor(s, alloc) for s in specs}

    def _call_args(
        self,
        g: LaunchGeometry,
        workspaces: tuple[torch.Tensor, torch.Tensor],
        common: dict[str, Any],
    ) -> dict[str, Any]:
        import cutlass.torch as cutlass_torch

        local, shared = workspaces

        def workspace(name: str) -> Any:
            # The drop's runner: static layout for the local workspace, dynamic for the shared.
            if name == "local_workspace":
                return cutlass_torch.from_dlpack(local, assumed_align=16)
            return cutlass_torch.from_dlpack(shared, assumed_align=16).mark_layout_dynamic(
                leading_dim=0
            )

        return args.call_args(
            g, pool_token_capacity=self._pool_token_capacity, workspace=workspace, **common
        )

"""`sm100_nvfp4_nvfp4_bf16_cutedsl`: the Blackwell CuTe DSL nvfp4 mega-MoE kernel.

Warning:
    NEVER RUN ON A GPU (no Blackwell machine was available); what is verified on CPU
    instead, for both sm100 CuTe DSL kernels, is listed in `moe_ep_sm100.common.cutedsl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moe_ep.backends.support.cutedsl.mega_kernel import StagedBuffers, raw_workspace_pointers
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
from moe_ep.registry import register_mega_kernel
from moe_ep_sm100.common.cutedsl import Sm100CutedslKernel
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl import args
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.config import (
    Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.layout import (
    Nvfp4Weights,
    prepare_nvfp4_weights,
    stage_nvfp4_inputs,
)
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.upstream import load_nvfp4_api

if TYPE_CHECKING:
    from moe_ep.types import MoEEpTensors, MoEWeightPack

__all__ = ["Sm100Nvfp4Nvfp4Bf16CutedslKernel"]


@register_mega_kernel("sm100_nvfp4_nvfp4_bf16_cutedsl", deprecated_aliases=("nvfp4_cutedsl",))
class Sm100Nvfp4Nvfp4Bf16CutedslKernel(Sm100CutedslKernel):
    """Fused dispatch + nvfp4 FC1 + SwiGLU + FC2 + combine (swap-AB), NVSHMEM peers.

    Weights are quantized once (`prepare_nvfp4_weights`: per-expert global scales, gate/up
    interleaved by 16, K-major, 128x4-swizzled e4m3 scales); activations per call with the
    config's static `input_norm_const`.
    """

    config_cls: ClassVar[type[Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig]] = (
        Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig
    )
    payload_dtype: ClassVar[torch.dtype] = torch.uint8

    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> Nvfp4Weights:
        w = weights.to(device)
        return prepare_nvfp4_weights(
            w.w13,
            w.w2,
            input_norm_const=self.cfg.input_norm_const,
            hidden_norm_const=self.cfg.hidden_norm_const,
            w13_scale=w.w13_scale,
            w2_scale=w.w2_scale,
            w13_global_scale=w.w13_global_scale,
            w2_global_scale=w.w2_global_scale,
        )

    def _stage(self, tensors: MoEEpTensors, max_tokens: int) -> StagedBuffers:
        return stage_nvfp4_inputs(
            tensors.hidden_states,
            tensors.topk_ids,
            tensors.topk_weights,
            max_tokens=max_tokens,
            input_norm_const=self.cfg.input_norm_const,
        )

    def _tensor_specs(self, g: LaunchGeometry) -> tuple[ArgSpec, ...]:
        return args.tensor_specs(g)

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        p = self.prepared
        return {
            **super()._weight_tensors(),
            "fc1_alpha": p.fc1_alpha,
            "fc2_alpha": p.fc2_alpha,
            "fc1_norm_const": p.fc1_norm_const,
        }

    def _make_kernel(self, g: LaunchGeometry) -> tuple[Any, Any, int]:
        api = load_nvfp4_api()
        kernel, clusters = args.build_kernel(self.cfg, g, api)
        return kernel, api, clusters

    def _call_args(
        self,
        g: LaunchGeometry,
        workspaces: tuple[torch.Tensor, torch.Tensor],
        common: dict[str, Any],
    ) -> dict[str, Any]:
        return args.call_args(g, pointer=raw_workspace_pointers(workspaces), **common)

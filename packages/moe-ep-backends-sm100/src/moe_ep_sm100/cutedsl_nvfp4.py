"""`sm100_nvfp4_nvfp4_bf16_cutedsl`: the Blackwell CuTe DSL nvfp4 mega-MoE kernel.

Warning:
    The launch path (`cutedsl_launch`) has NEVER RUN ON A GPU (no Blackwell machine was
    available). What is tested on CPU: config validation, availability, weight preparation
    and input staging (`nvfp4_layout`), the lifecycle with compile/launch faked, the launch
    glue with cutlass / NVSHMEM / cuda-bindings faked (`test_sm100_launch_glue`), and that
    the kernel compiles for sm_100a with the arguments `nvfp4_args` builds
    (`compile_check`), the same functions the launch uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moe_ep.backends.support.cutedsl_kernel import StagedBuffers
from moe_ep.registry import register_mega_kernel
from moe_ep_sm100 import nvfp4_args
from moe_ep_sm100.configs import Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig
from moe_ep_sm100.cutedsl_launch import CUTEDSL_PACKAGES, Sm100CutedslKernel, raw_workspace_pointers
from moe_ep_sm100.drops import load_nvfp4_api
from moe_ep_sm100.nvfp4_args import ArgSpec, Geometry
from moe_ep_sm100.nvfp4_layout import Nvfp4Weights, prepare_nvfp4_weights, stage_nvfp4_inputs

if TYPE_CHECKING:
    from moe_ep.types import MoEEpTensors, MoEWeightPack

__all__ = ["CUTEDSL_PACKAGES", "Sm100Nvfp4Nvfp4Bf16CutedslKernel"]


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

    def _tensor_specs(self, g: Geometry) -> tuple[ArgSpec, ...]:
        return nvfp4_args.tensor_specs(g)

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        p = self.prepared
        return {
            **super()._weight_tensors(),
            "fc1_alpha": p.fc1_alpha,
            "fc2_alpha": p.fc2_alpha,
            "fc1_norm_const": p.fc1_norm_const,
        }

    def _make_kernel(self, g: Geometry) -> tuple[Any, Any, int]:
        api = load_nvfp4_api()
        kernel, clusters = nvfp4_args.build_kernel(self.cfg, g, api)
        return kernel, api, clusters

    def _call_args(
        self, g: Geometry, workspaces: tuple[torch.Tensor, torch.Tensor], common: dict[str, Any]
    ) -> dict[str, Any]:
        return nvfp4_args.call_args(g, pointer=raw_workspace_pointers(workspaces), **common)

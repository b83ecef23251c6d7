"""`sm90_fp8_nvfp4_bf16_pull_cutedsl`: the Hopper pull-style CuTe DSL mega-MoE kernel, e4m3
activations (one fp32 scale per token, `mxfp4_hybrid`) x nvfp4 weights.

Warning:
    The launch path (`warmup`, `compute_staged`, the symmetric workspaces) has NEVER RUN ON
    A GPU. What is verified on CPU: the config and its knobs (they reach the drop's
    constructor), the weights' logical ABI against references written from the layout's
    definition, the host quantization against the portable twin bit for bit, the staging,
    this class's launch path on recording fakes, and that the kernel compiles for `sm_90a`
    with exactly the arguments `args` builds. See docs/backends.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from moe_ep.backends.portable.kernel import Fp8Nvfp4TorchKernel
from moe_ep.backends.support.cutedsl.mega_kernel import CompiledEntry, StagedBuffers, free_entry
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, check_pack_geometry
from moe_ep.backends.support.pooling.workspace_pool import WorkspacePool
from moe_ep.checks import PackShape
from moe_ep.registry import register_mega_kernel
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.kernel import (
    Sm90Fp8Mxfp4Bf16PullCutedslKernel,
)
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.args import build_kernel, tensor_specs
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.layout import (
    nvfp4_pull_legs,
    stage_nvfp4_inputs,
)
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.upstream import (
    load_nvfp4_api,
    nvfp4_availability,
)

if TYPE_CHECKING:
    import torch

    from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["Sm90Fp8Nvfp4Bf16PullCutedslKernel"]

_POOL: WorkspacePool[CompiledEntry] = WorkspacePool(free=free_entry)


@register_mega_kernel("sm90_fp8_nvfp4_bf16_pull_cutedsl")
class Sm90Fp8Nvfp4Bf16PullCutedslKernel(Sm90Fp8Mxfp4Bf16PullCutedslKernel):
    """Fused dispatch (peers pull e4m3 tokens over NVLink) + FC1 + SwiGLU + FC2 + combine,
    nvfp4 weights promoted to e4m3 in registers (FlashInfer's
    `Sm90MegaMoESwapABNvfp4Fp8Kernel`, the MXFP4 kernel's subclass; this class is the MXFP4
    wrapper's with the NVFP4 weights, staging, drop and knobs).

    Weights are prepared once in `__init__` (`layout.nvfp4_pull_legs`): quantized to nvfp4
    here from bf16/fp32 weights (the portable twin's rule: one decode scale G per expert and
    leg), or taken from a pre-quantized pack (`w13 [E, 2I, H/2]` uint8 codes,
    `w13_scale [E, 2I, H/16]` e4m3, `w13_global_scale [E]` fp32 G or None = 1, likewise `w2`),
    K-permuted by `nvfp4_kperm`, FC1 gate/up interleaved by 8, folded into the kernel's tiles,
    `8 * G` in the weight dequant-scale slot. Inputs are quantized per call (one fp32 scale
    per token, H in `nvfp4_kperm` order) into symmetric staging buffers. Layers with the
    same config and geometry share one compiled kernel and its workspaces (`WorkspacePool`).
    Upstream (flashinfer 0.7.4) registers this name with no deprecated alias.
    """

    config_cls: ClassVar[type[Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig]] = (
        Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig
    )
    pool: ClassVar[WorkspacePool[CompiledEntry]] = _POOL
    cfg: Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return nvfp4_availability()

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: the portable twin's pack checks (bf16/fp32
        weights, finite; or an nvfp4 pack: e4m3 planes of its shape with bytes 0..126,
        positive finite fp32 decode scales), then the config's geometry rules (H, I
        multiples of 128, top_k)."""
        shape = Fp8Nvfp4TorchKernel.validate_weights(weights, fleet, world_size, config)
        check_pack_geometry(config, fleet, world_size, shape)
        return shape

    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> Any:
        return nvfp4_pull_legs(weights.to(device), kperm=self.cfg.nvfp4_kperm)

    def _make_kernel(self, g: LaunchGeometry) -> tuple[Any, Any, int]:
        api = load_nvfp4_api()
        kernel, clusters = build_kernel(self.cfg, g, api)
        return kernel, api, clusters

    def _tensor_specs(self, g: LaunchGeometry) -> tuple[ArgSpec, ...]:
        return tensor_specs(g)

    def _stage(self, tensors: MoEEpTensors, max_tokens: int) -> StagedBuffers:
        return stage_nvfp4_inputs(
            tensors.hidden_states, tensors.topk_ids, tensors.topk_weights,
            max_tokens=max_tokens, kperm=self.cfg.nvfp4_kperm,
        )  # fmt: skip

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """Per leg: the packed codes, the folded K16 scales, `8 * G` (the weight
        dequant-scale slot)."""
        fc1, fc2 = self.prepared
        return {
            "fc1_weight": fc1.weight,
            "fc1_weight_sf": fc1.scales,
            "fc1_weight_dequant_scale": fc1.decode_x8,
            "fc2_weight": fc2.weight,
            "fc2_weight_sf": fc2.scales,
            "fc2_weight_dequant_scale": fc2.decode_x8,
        }

"""`sm90_fp8_mxfp4_bf16_pull_cutedsl`: the Hopper pull-style CuTe DSL mega-MoE kernel,
e4m3 activations x mxfp4 weights (`fp8_scale_mode="mxfp4_hybrid"`).

Warning:
    The launch path (`warmup`, `compute_staged`, the symmetric workspaces) has NEVER RUN ON
    A GPU. What is verified on CPU: the config's fixed contract, the weights' logical ABI
    against the drop's e2m1 -> e4m3 PTX and the portable twin (`layout`), their physical
    tiles against a thread-by-thread restatement of the drop's mainloop (`tile_fold`), the
    staging, this class's launch path on recording fakes, and that the kernel compiles for
    `sm_90a` with exactly the arguments `args` builds. See docs/backends.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from moe_ep.backends.portable.kernel import Fp8Mxfp4TorchKernel
from moe_ep.backends.support.cutedsl.mega_kernel import (
    STAGED,
    CompiledEntry,
    StagedBuffers,
    free_entry,
)
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, check_pack_geometry
from moe_ep.backends.support.pooling.workspace_pool import WorkspacePool
from moe_ep.checks import PackShape
from moe_ep.contract import RuntimeRequirements
from moe_ep.registry import register_mega_kernel
from moe_ep_sm90.common.pull_kernel import Sm90PullCutedslKernel
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.args import build_kernel, tensor_specs
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.layout import (
    mxfp4_pull_legs,
    stage_mxfp4_hybrid_inputs,
)
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.upstream import load_mxfp4_api

if TYPE_CHECKING:
    import torch

    from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["Sm90Fp8Mxfp4Bf16PullCutedslKernel"]

_POOL: WorkspacePool[CompiledEntry] = WorkspacePool(free=free_entry)


@register_mega_kernel("sm90_fp8_mxfp4_bf16_pull_cutedsl")
class Sm90Fp8Mxfp4Bf16PullCutedslKernel(Sm90PullCutedslKernel):
    """Fused dispatch (peers pull e4m3 tokens over NVLink) + FC1 + SwiGLU + FC2 + combine,
    mxfp4 weights expanded to e4m3 in registers (the drop's `Sm90MegaMoESwapABMxfp4Fp8Kernel`).

    Weights are prepared once in `__init__` (`layout.mxfp4_pull_legs`): quantized to mxfp4
    here from bf16/fp32 weights, or taken from a pre-quantized mxfp4 pack (`w13 [E, 2I, H/2]`
    uint8 codes with `w13_scale [E, 2I, H/32]` E8M0 bytes, likewise `w2`), the exponents
    clamped to 11 binades per expert, FC1 gate/up interleaved by 8, folded into the kernel's
    tiles. Inputs are quantized per call (one fp32 scale per token) into symmetric staging
    buffers of `max_tokens_per_rank` rows; padded rows carry id -1. Layers with the same
    config and geometry share one compiled kernel and its workspaces (`WorkspacePool`).
    Upstream (flashinfer 0.7.4) registers this name with no deprecated alias.
    """

    config_cls: ClassVar[type[Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig]] = (
        Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig
    )
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=True)
    pool: ClassVar[WorkspacePool[CompiledEntry]] = _POOL
    # The output too is on the symmetric heap: peers write their combine results into it.
    symmetric_staging: ClassVar[tuple[str, ...]] = STAGED

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: the portable twin's pack checks (bf16/fp32
        weights, finite; or an mxfp4 pack with E8M0 planes of its shape, no NaN byte), then
        the config's geometry rules (H, I multiples of 128, top_k)."""
        shape = Fp8Mxfp4TorchKernel.validate_weights(weights, fleet, world_size, config)
        check_pack_geometry(config, fleet, world_size, shape)
        return shape

    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> Any:
        w = weights.to(device)
        return mxfp4_pull_legs(w.w13, w.w2, w.w13_scale, w.w2_scale)

    # -- CutedslMegaKernel -------------------------------------------------------------
    def _make_kernel(self, g: LaunchGeometry) -> tuple[Any, Any, int]:
        api = load_mxfp4_api()
        kernel, clusters = build_kernel(self.cfg, g, api)
        return kernel, api, clusters

    def _tensor_specs(self, g: LaunchGeometry) -> tuple[ArgSpec, ...]:
        return tensor_specs(g)

    def _stage(self, tensors: MoEEpTensors, max_tokens: int) -> StagedBuffers:
        return stage_mxfp4_hybrid_inputs(
            tensors.hidden_states, tensors.topk_ids, tensors.topk_weights, max_tokens=max_tokens
        )

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """Per leg: the packed codes, the folded offsets, the per-expert residual (the
        weight dequant-scale slot)."""
        fc1, fc2 = self.prepared
        return {
            "fc1_weight": fc1.weight,
            "fc1_weight_sf": fc1.offsets,
            "fc1_weight_dequant_scale": fc1.scale,
            "fc2_weight": fc2.weight,
            "fc2_weight_sf": fc2.offsets,
            "fc2_weight_dequant_scale": fc2.scale,
        }

    def _local_tensors(self, g: LaunchGeometry, device: torch.device) -> dict[str, torch.Tensor]:
        """The two unit activation dequant scales (the per-token scales carry the values)."""
        import torch

        return {
            name: torch.ones((1,), dtype=torch.float32, device=device)
            for name in ("fc1_activation_dequant_scale", "fc2_activation_dequant_scale")
        }

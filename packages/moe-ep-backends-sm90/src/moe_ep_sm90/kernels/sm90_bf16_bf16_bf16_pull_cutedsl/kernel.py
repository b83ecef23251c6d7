"""`sm90_bf16_bf16_bf16_pull_cutedsl`: the Hopper pull-style CuTe DSL mega-MoE kernel, bf16.

Warning:
    The launch path (`warmup`, `compute_staged`, the symmetric workspaces) has NEVER RUN ON
    A GPU. What is verified on CPU: config validation, weight and input layouts (`layout`,
    against the drop's own reference `compute_megamoe_reference_bf16` run on CPU), and that
    the kernel compiles for `sm_90a` with exactly the arguments this module builds (`args`,
    `compile`). See docs/backends.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from moe_ep.backends.support.cutedsl.mega_kernel import (
    STAGED,
    CompiledEntry,
    StagedBuffers,
    free_entry,
)
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry, check_pack_geometry
from moe_ep.backends.support.pooling.workspace_pool import WorkspacePool
from moe_ep.checks import PackShape, check_weight_pack
from moe_ep.contract import RuntimeRequirements
from moe_ep.registry import register_mega_kernel
from moe_ep_sm90.common.pull_kernel import Sm90PullCutedslKernel
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.args import (
    build_kernel,
    tensor_specs,
)
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.config import (
    Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.layout import (
    prepare_bf16_pull_weights,
    stage_bf16_pull_inputs,
)
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.upstream import load_bf16_pull_api

if TYPE_CHECKING:
    import torch

    from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["Sm90Bf16Bf16Bf16PullCutedslKernel"]

_POOL: WorkspacePool[CompiledEntry] = WorkspacePool(free=free_entry)


@register_mega_kernel("sm90_bf16_bf16_bf16_pull_cutedsl")
class Sm90Bf16Bf16Bf16PullCutedslKernel(Sm90PullCutedslKernel):
    """Fused dispatch (peers pull bf16 tokens over NVLink) + FC1 + SwiGLU + FC2 + combine.

    Weights are laid out once in `__init__` (`layout.prepare_bf16_pull_weights`: FC1
    gate/up interleaved by 8, K-major views; no quantization); pre-quantized packs are
    refused (a bf16 kernel has nothing to read their scales with). Inputs are copied per
    call into symmetric bf16 staging buffers of `max_tokens_per_rank` rows; padded rows
    carry id -1. Layers with the same config and geometry share one compiled kernel and
    its workspaces (`WorkspacePool`). Upstream has no deprecated alias for this name.
    """

    config_cls: ClassVar[type[Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig]] = (
        Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig
    )
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=True)
    pool: ClassVar[WorkspacePool[CompiledEntry]] = _POOL
    # Peers pull the activation and routing and write their combine results into the
    # output; there is no activation scale plane.
    symmetric_staging: ClassVar[tuple[str, ...]] = tuple(n for n in STAGED if n != "activation_sf")

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: bf16/fp32 weights only (no scales), pack
        shapes, the config's geometry rules (H % 256, I % 128, top_k)."""
        shape = check_weight_pack(weights, fleet, world_size)
        check_pack_geometry(config, fleet, world_size, shape)
        return shape

    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> Any:
        return prepare_bf16_pull_weights(weights.w13.to(device), weights.w2.to(device))

    # -- CutedslMegaKernel -------------------------------------------------------------
    def _make_kernel(self, g: LaunchGeometry) -> tuple[Any, Any, int]:
        api = load_bf16_pull_api()
        kernel, clusters = build_kernel(self.cfg, g, api)
        return kernel, api, clusters

    def _tensor_specs(self, g: LaunchGeometry) -> tuple[ArgSpec, ...]:
        return tensor_specs(g)

    def _stage(self, tensors: MoEEpTensors, max_tokens: int) -> StagedBuffers:
        return stage_bf16_pull_inputs(
            tensors.hidden_states, tensors.topk_ids, tensors.topk_weights, max_tokens=max_tokens
        )

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """The two bf16 weight tensors (no scale planes)."""
        return {"fc1_weight": self.prepared.w13, "fc2_weight": self.prepared.w2}

"""`sm90_fp8_fp8_bf16_pull_cutedsl`: the Hopper pull-style CuTe DSL mega-MoE kernel.

Warning:
    The launch path (`warmup`, `compute_staged`, the symmetric workspaces) has NEVER RUN ON
    A GPU. What is verified on CPU: config validation, weight and input layouts
    (`layout`), and that the kernel compiles for `sm_90a` with exactly the arguments this
    module builds (`args`, `compile`). See docs/backends.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from moe_ep.backends.support.cutedsl.mega_kernel import (
    STAGED,
    CompiledEntry,
    StagedBuffers,
    free_entry,
)
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
from moe_ep.backends.support.pooling.workspace_pool import WorkspacePool
from moe_ep.checks import PackShape
from moe_ep.contract import RuntimeRequirements
from moe_ep.registry import register_mega_kernel
from moe_ep_sm90.common.fp8_packs import check_pack
from moe_ep_sm90.common.pull_kernel import Sm90PullCutedslKernel
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.args import (
    build_kernel,
    tensor_specs,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.config import (
    PULL_GATE_UP_BLOCK,
    Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.layout import (
    prepare_pull_weights,
    pull_weights_from_pack,
    stage_pull_inputs,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.upstream import load_pull_api

if TYPE_CHECKING:
    import torch

    from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["Sm90Fp8Fp8Bf16PullCutedslKernel"]

_POOL: WorkspacePool[CompiledEntry] = WorkspacePool(free=free_entry)


@register_mega_kernel("sm90_fp8_fp8_bf16_pull_cutedsl", deprecated_aliases=("sm90_pull_fp8",))
class Sm90Fp8Fp8Bf16PullCutedslKernel(Sm90PullCutedslKernel):
    """Fused dispatch (peers pull tokens over NVLink) + FC1 + SwiGLU + FC2 + combine, fp8.

    Weights are quantized once in `__init__` (`layout.prepare_pull_weights`, blockwise
    128x128, FC1 gate/up interleaved by 8, K-major views), or taken from a pre-quantized
    pack that fits that recipe (`common.fp8_packs`; see the config's
    `prequantized_fc1_gate_up_interleave`). Inputs are quantized per call
    (1x128) into symmetric staging buffers of `max_tokens_per_rank` rows; padded rows carry
    id -1. Layers with the same config and geometry share one compiled kernel and its
    workspaces (`WorkspacePool`).
    """

    config_cls: ClassVar[type[Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig]] = (
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig
    )
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=True)
    pool: ClassVar[WorkspacePool[CompiledEntry]] = _POOL
    # The output too is on the symmetric heap: peers write their combine results into it.
    symmetric_staging: ClassVar[tuple[str, ...]] = STAGED

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: pack shapes, dtypes, a pre-quantized pack's
        fit to the kernel's recipe (`common.fp8_packs`), geometry."""
        return check_pack(
            cls.kernel_name,
            weights,
            fleet,
            world_size,
            config,
            kernel_fc1_interleave=PULL_GATE_UP_BLOCK,
        )

    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> Any:
        if weights.prequantized:
            return pull_weights_from_pack(
                weights.to(device),
                pack_fc1_interleave=self.cfg.prequantized_fc1_gate_up_interleave,
            )
        return prepare_pull_weights(weights.w13.to(device), weights.w2.to(device))

    # -- CutedslMegaKernel -------------------------------------------------------------
    def _make_kernel(self, g: LaunchGeometry) -> tuple[Any, Any, int]:
        api = load_pull_api()
        kernel, clusters = build_kernel(self.cfg, g, api)
        return kernel, api, clusters

    def _tensor_specs(self, g: LaunchGeometry) -> tuple[ArgSpec, ...]:
        return tensor_specs(g)

    def _stage(self, tensors: MoEEpTensors, max_tokens: int) -> StagedBuffers:
        return stage_pull_inputs(
            tensors.hidden_states, tensors.topk_ids, tensors.topk_weights, max_tokens=max_tokens
        )

    def _local_tensors(self, g: LaunchGeometry, device: torch.device) -> dict[str, torch.Tensor]:
        """The four unit dequant scales (the blockwise scales carry the values)."""
        import torch

        return {
            name: torch.ones((numel,), dtype=torch.float32, device=device)
            for name, numel in (
                ("fc1_activation_dequant_scale", 1),
                ("fc2_activation_dequant_scale", 1),
                ("fc1_weight_dequant_scale", g.experts_per_rank),
                ("fc2_weight_dequant_scale", g.experts_per_rank),
            )
        }

"""`sm100_fp8_fp4_bf16_deepgemm`: DeepGEMM's Blackwell fp8 x fp4 mega-MoE.

Warning:
    NEVER RUN: no Blackwell GPU and no `deep_gemm` build were available. DeepGEMM is not on
    PyPI (build it from github.com/deepseek-ai/DeepGEMM against the local CUDA toolkit). The
    calls into `deep_gemm` (`_compile`, `_launch`) were written from reading its sources
    (files and commits in docs/backends.md); what is tested on CPU: the weight layout and
    input staging (`layout`), availability and the API check (`upstream`), and
    the lifecycle with `deep_gemm` replaced by a recording fake module
    (`tests/backends/test_sm100_deepgemm_lifecycle.py`).

Lifecycle (the pattern of the other pooled kernels): weights are prepared once in `__init__`
on the runtime's device; the first `warmup()` (with `config.top_k` set) or the first forward
allocates DeepGEMM's symmetric buffer for (config, geometry, device) with
`deep_gemm.get_symm_buffer_for_mega_moe` (collective: torch symmetric memory over the EP
group, no NVSHMEM); layers of identical geometry share it through a ref-counted
`WorkspacePool`; the last `destroy()` frees it after a barrier. `stage_inputs` quantizes
(`stage_deepgemm_inputs`) and copies the T staged rows into the buffer's input views;
`compute_staged` calls `deep_gemm.fp8_fp4_mega_moe` with the layer's output as `y`.

Numerics (DeepGEMM's compute graph): FC1 on fp8 1x32 UE8M0 activations x mxfp4 weights,
SwiGLU on gate/up interleaved by 8 (optional clamp: gate <= c, -c <= up <= c), the top-k
weight applied to the SwiGLU output before its fp8 1x32 UE8M0 quantization, FC2, bf16
combine. `fast_math=False` is passed (exact SwiGLU, closest to the portable oracle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moe_ep.backends.support.pooling.pooled_kernel import PooledKernel, StagedCall
from moe_ep.backends.support.pooling.workspace_pool import WorkspacePool
from moe_ep.checks import PackShape
from moe_ep.contract import RuntimeRequirements
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError
from moe_ep.registry import register_mega_kernel
from moe_ep_sm100.common.pack_check import check_sm100_pack
from moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.config import (
    Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.layout import (
    DeepgemmWeights,
    prepare_deepgemm_weights,
    stage_deepgemm_inputs,
)
from moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.upstream import (
    deepgemm_availability,
    load_deep_gemm,
)

if TYPE_CHECKING:
    import torch

    from moe_ep.backends.support.launch_args import LaunchGeometry
    from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = [
    "DEEPGEMM_RECIPE",
    "DEEPGEMM_SHAPE_MULTIPLE",
    "DeepgemmEntry",
    "Sm100Fp8Fp4Bf16DeepgemmKernel",
    "check_buffer_views",
]

DEEPGEMM_RECIPE = (1, 1, 32)
"""(activation rows, weight rows, K) per scale: the only recipe the mega-MoE accepts."""
DEEPGEMM_SHAPE_MULTIPLE = Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig.shape_multiple
"""H and I: one token's activation scales (H/32 UE8M0 bytes) must fill whole 16-byte TMA
units (DeepGEMM PR #371 describes this rule and proposes relaxing it; not relied on)."""


@dataclass
class DeepgemmEntry:
    """One pooled symmetric buffer and the `deep_gemm` module that made it."""

    api: Any
    buffer: Any


def _free(entry: DeepgemmEntry) -> None:
    entry.buffer.destroy()


POOL: WorkspacePool[DeepgemmEntry] = WorkspacePool(free=_free)


def check_buffer_views(buffer: Any, g: LaunchGeometry) -> None:
    """`MoeEpUnavailableError` unless `buffer`'s input views are the documented ones:
    `x [>=T, H]` e4m3, `x_sf [>=T, H/128]` int32, `topk_idx [>=T, k]` int64,
    `topk_weights [>=T, k]` fp32 (T = max tokens per rank)."""
    import torch

    t, h, k = g.max_tokens_per_rank, g.hidden_size, g.top_k
    want = {
        "x": (torch.float8_e4m3fn, h),
        "x_sf": (torch.int32, h // 128),
        "topk_idx": (torch.int64, k),
        "topk_weights": (torch.float32, k),
    }
    for name, (dtype, cols) in want.items():
        v = getattr(buffer, name, None)
        if v is None or v.dtype != dtype or v.dim() != 2 or v.shape[0] < t or v.shape[1] != cols:
            got = "missing" if v is None else f"{v.dtype} {list(v.shape)}"
            raise MoeEpUnavailableError(
                f"deep_gemm's SymmBuffer.{name} is {got}; this wrapper was written for "
                f"{dtype} [>= {t}, {cols}] (max_tokens_per_rank={t}, H={h}, k={k})"
            )


def _check_dims(kernel: str, hidden: int, intermediate: int) -> None:
    m = DEEPGEMM_SHAPE_MULTIPLE
    for field, v in (("hidden_size", hidden), ("intermediate_size", intermediate)):
        if v % m:
            raise MoeEpUsageError(
                f"{kernel}: {field} must be a multiple of {m} (DeepGEMM's mega-MoE: H/32 and "
                f"I/32 scale bytes per token fill 16-byte TMA units), got {v}"
            )


def _checked_intermediate(
    kernel: str, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
) -> PackShape:
    """The shape of a pack (bf16/fp32, or packed mxfp4 uint8 with scales) after the local
    checks."""
    shape = check_sm100_pack(weights, fleet, world_size, config, payload_dtype=torch.uint8)
    _check_dims(kernel, shape.hidden_size, shape.intermediate_size)
    return shape


@register_mega_kernel("sm100_fp8_fp4_bf16_deepgemm", deprecated_aliases=("deep_gemm_mega",))
class Sm100Fp8Fp4Bf16DeepgemmKernel(PooledKernel):
    """Fused dispatch + fp8 x fp4 FC1 + SwiGLU + FC2 + combine from the `deep_gemm` package.

    Weights are quantized once (`prepare_deepgemm_weights`: mxfp4, gate/up interleaved by 8,
    packed UE8M0 scales MN-major with the UTCCP row order); activations per call.
    """

    config_cls: ClassVar[type[Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig]] = (
        Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig
    )
    # deep_gemm allocates its own symmetric buffer through torch; no NVSHMEM bootstrap.
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=False)
    pool: ClassVar[WorkspacePool[Any]] = POOL
    build_verb: ClassVar[str] = "allocate its symmetric buffer"
    prepared: DeepgemmWeights

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return deepgemm_availability()

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: pack shapes, geometry, the 512 rule."""
        return _checked_intermediate(cls.kernel_name, weights, fleet, world_size, config)

    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> DeepgemmWeights:
        w = weights.to(device)
        return prepare_deepgemm_weights(w.w13, w.w2, w.w13_scale, w.w2_scale)

    # -- MegaKernel ---------------------------------------------------------------------
    def stage_inputs(self, *, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Quantize this rank's inputs and copy them into the pooled symmetric buffer."""
        g = self._ensure_geometry(int(tensors.topk_ids.shape[1]))
        staged = stage_deepgemm_inputs(
            tensors.hidden_states,
            tensors.topk_ids,
            tensors.topk_weights,
            max_tokens=g.max_tokens_per_rank,
        )
        buf = self._entry().buffer
        t = g.max_tokens_per_rank
        buf.x[:t].copy_(staged.activation)
        buf.x_sf[:t].copy_(staged.activation_scales)
        buf.topk_idx[:t].copy_(staged.topk_ids)
        buf.topk_weights[:t].copy_(staged.topk_weights)
        return StagedCall(staged, output)

    def compute_staged(self, *, staged: Any) -> torch.Tensor:
        """Launch on the staged buffer; the kernel writes the n live rows of the output."""
        import torch

        entry: DeepgemmEntry = self._entry()
        out = staged.output
        n = staged.inputs.num_tokens
        direct = out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape[0] == n
        y = (
            out
            if direct
            else torch.empty((n, out.shape[1]), dtype=torch.bfloat16, device=out.device)
        )
        self._launch(entry, y)
        if not direct:
            out[:n].copy_(y)
        return out

    # -- internals ----------------------------------------------------------------------
    def _compile(self, g: LaunchGeometry) -> DeepgemmEntry:
        """Allocate DeepGEMM's symmetric buffer (collective; GPU only, never run)."""
        import torch

        api = load_deep_gemm()
        buffer = api.get_symm_buffer_for_mega_moe(
            group=self.runtime.group,
            num_experts=g.num_experts,
            num_max_tokens_per_rank=g.max_tokens_per_rank,
            num_topk=g.top_k,
            hidden=g.hidden_size,
            intermediate_hidden=g.intermediate_size,
        )
        try:
            check_buffer_views(buffer, g)
        except MoeEpUnavailableError:
            buffer.destroy()
            raise
        buffer.topk_idx.fill_(-1)
        dev = self.runtime.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.runtime.barrier()
        return DeepgemmEntry(api=api, buffer=buffer)

    def _launch(self, entry: DeepgemmEntry, y: torch.Tensor) -> None:
        p = self.prepared
        entry.api.fp8_fp4_mega_moe(
            y=y,
            l1_weights=(p.w13, p.w13_scales),
            l2_weights=(p.w2, p.w2_scales),
            sym_buffer=entry.buffer,
            recipe=DEEPGEMM_RECIPE,
            activation="swiglu",
            activation_clamp=self.cfg.gate_up_clamp,
            fast_math=False,
        )

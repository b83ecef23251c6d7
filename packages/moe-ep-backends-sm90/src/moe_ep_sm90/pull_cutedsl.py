"""`sm90_fp8_fp8_bf16_pull_cutedsl`: the Hopper pull-style CuTe DSL mega-MoE kernel.

Warning:
    The launch path (`warmup`, `compute_staged`, the symmetric workspaces) has NEVER RUN ON
    A GPU. What is verified on CPU: config validation, weight and input layouts
    (`fp8_layout`), and that the kernel compiles for `sm_90a` with exactly the arguments this
    module builds (`pull_args`, `compile_check`). See docs/backends.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from moe_ep.backends.support.cute_launch import (
    check_symmetric_heap,
    clear_padded_cells,
    combine_view,
    current_stream,
    cute_tensor,
    peer_offsets,
)
from moe_ep.backends.support.cute_launch import combine_region as _combine_region
from moe_ep.backends.support.hardware import check_availability
from moe_ep.backends.support.pool import WorkspacePool
from moe_ep.backends.support.pooled import PooledKernel, StagedCall, compile_collective
from moe_ep.checks import PackShape
from moe_ep.contract import RuntimeRequirements
from moe_ep.registry import register_mega_kernel
from moe_ep_sm90.configs import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig
from moe_ep_sm90.drops import PULL_DROP, load_pull_api
from moe_ep_sm90.fp8_layout import (
    PULL_GATE_UP_BLOCK,
    check_pack,
    prepare_pull_weights,
    stage_pull_inputs,
)
from moe_ep_sm90.pull_args import (
    ArgSpec,
    PullGeometry,
    call_args,
    kernel_class,
    kernel_ctor_kwargs,
    tensor_specs,
)

if TYPE_CHECKING:
    import torch

    from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["Sm90Fp8Fp8Bf16PullCutedslKernel"]

_PACKAGES = (
    ("cutlass", "nvidia-cutlass-dsl"),
    ("cuda.bindings", "cuda-bindings"),
    ("nvshmem", "nvshmem4py-cu13"),
)


COMBINE_REGION = "unreduced_expert_output"
"""The drop kernel's shared-workspace region of per-(token, slot) bf16 combine cells
`[T, k, H]`, which its separate top-k reduce sums (`fc2_in_kernel_topk_reduce=False`)."""


@dataclass
class _Compiled:
    """One compiled kernel with its workspaces and symmetric staging buffers (pooled across
    layers of one geometry; each launch passes its layer's weights and the current stream).
    """

    compiled: Any
    local_workspace: torch.Tensor
    shared_workspace: torch.Tensor
    staging: dict[str, torch.Tensor]
    """Symmetric-heap tensors peers read: activation, activation_sf, topk_idx, topk_weights,
    and the output; plus the four unit dequant scales (local)."""
    peer_map: Any
    launch_args: dict[str, Any]
    """The call's keyword arguments without `stream` and the weights (per launch)."""
    combine: torch.Tensor | None = None
    """The `[T, k, H]` bf16 combine cells inside the shared workspace (`combine_region`)."""
    staged_by: Any = None
    """The `StagedCall` whose inputs the staging buffers hold."""


def _free(entry: _Compiled) -> None:
    import nvshmem.core

    for name in ("activation", "activation_sf", "topk_idx", "topk_weights", "output_activation"):
        nvshmem.core.free_tensor(entry.staging[name])
    nvshmem.core.free_tensor(entry.shared_workspace)


_POOL: WorkspacePool[_Compiled] = WorkspacePool(free=_free)


@register_mega_kernel("sm90_fp8_fp8_bf16_pull_cutedsl", deprecated_aliases=("sm90_pull_fp8",))
class Sm90Fp8Fp8Bf16PullCutedslKernel(PooledKernel):
    """Fused dispatch (peers pull tokens over NVLink) + FC1 + SwiGLU + FC2 + combine, fp8.

    Weights are quantized once in `__init__` (`fp8_layout.prepare_pull_weights`, blockwise
    128x128, FC1 gate/up interleaved by 8, K-major views), or taken from a pre-quantized
    pack that fits that recipe (`fp8_packs`; see the config's
    `prequantized_fc1_gate_up_interleave`). Inputs are quantized per call
    (1x128) into symmetric staging buffers of `max_tokens_per_rank` rows; padded rows carry
    id -1. Layers with the same config and geometry share one compiled kernel and its
    workspaces (`WorkspacePool`).
    """

    config_cls: ClassVar[type[Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig]] = (
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig
    )
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=True)
    pool: ClassVar[WorkspacePool[_Compiled]] = _POOL

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return check_availability(
            capability=(9, 0), arch_label="Hopper, sm_90a", packages=_PACKAGES, drop=PULL_DROP
        )

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: pack shapes, dtypes, a pre-quantized pack's
        fit to the kernel's recipe (`fp8_packs`), geometry."""
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
            from moe_ep_sm90.fp8_packs import pull_weights_from_pack

            return pull_weights_from_pack(
                weights.to(device),
                pack_fc1_interleave=self.cfg.prequantized_fc1_gate_up_interleave,
            )
        return prepare_pull_weights(weights.w13.to(device), weights.w2.to(device))

    # -- staging ------------------------------------------------------------------------
    def stage_inputs(self, *, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Quantize this rank's inputs (`stage_pull_inputs`) into the symmetric buffers."""
        g = self._ensure_geometry(tensors.topk_ids.shape[1])
        staged = stage_pull_inputs(
            tensors.hidden_states,
            tensors.topk_ids,
            tensors.topk_weights,
            max_tokens=g.max_tokens_per_rank,
        )
        entry: _Compiled = self._entry()
        buf = entry.staging
        buf["activation"].copy_(staged.activation)
        if staged.activation_scales is not None:
            buf["activation_sf"].copy_(staged.activation_scales)
        buf["topk_idx"].copy_(staged.topk_ids)
        buf["topk_weights"].copy_(staged.topk_weights)
        return self._hold_staging(entry, StagedCall(staged, output))

    def compute_staged(self, *, staged: Any) -> torch.Tensor:
        """Launch the compiled kernel on the staged buffers; copies the live rows out.

        `staged` must be the last `stage_inputs` of any layer sharing this pooled entry
        (their staging buffers are one set): `MoeEpUsageError` otherwise.
        """
        entry: _Compiled = self._entry()
        self._take_staging(entry, staged)
        n = staged.inputs.num_tokens
        if entry.combine is not None:
            clear_padded_cells(entry.combine, entry.staging["topk_idx"], n)
        self._launch(entry)
        staged.output[:n].copy_(entry.staging["output_activation"][:n])
        return staged.output

    # -- internals ----------------------------------------------------------------------
    def _compile(self, g: PullGeometry) -> _Compiled:
        import cutlass
        import cutlass.cute as cute
        import cutlass.torch as cutlass_torch
        import nvshmem.core
        import torch
        from cutlass.cute.typing import AddressSpace

        api = load_pull_api()
        clusters = self.cfg.resolved_max_active_clusters
        kernel = kernel_class(self.cfg, api)(
            **kernel_ctor_kwargs(
                self.cfg, g, api=api, ab_dtype=cutlass.Float8E4M3FN, max_active_clusters=clusters
            )
        )
        cells_at = combine_region(kernel, g)  # the drop still has the cells we clear
        local_bytes, shared_bytes = kernel.get_workspace_sizes()
        sym_sizes = {s.name: _nbytes(s.shape, getattr(torch, s.dtype)) for s in _staging_specs(g)}
        check_symmetric_heap(self.kernel_name, {"shared workspace": shared_bytes, **sym_sizes})
        dev = self.runtime.device
        local_ws = torch.zeros((local_bytes,), dtype=torch.uint8, device=dev)
        shared_ws = nvshmem.core.tensor((shared_bytes,), dtype=torch.uint8)
        shared_ws.zero_()
        staging: dict[str, torch.Tensor] = {}
        for spec in _staging_specs(g):
            staging[spec.name] = symmetric_zeros(spec.shape, getattr(torch, spec.dtype))
        staging["topk_idx"].fill_(-1)
        weights_by_name = _weights_by_name(self.prepared)
        for name, numel in (
            ("fc1_activation_dequant_scale", 1),
            ("fc2_activation_dequant_scale", 1),
            ("fc1_weight_dequant_scale", g.experts_per_rank),
            ("fc2_weight_dequant_scale", g.experts_per_rank),
        ):
            staging[name] = torch.ones((numel,), dtype=torch.float32, device=dev)
        base = int(shared_ws.data_ptr())
        offsets = peer_offsets(shared_ws, g.world_size, g.rank)
        peer_map = api.sym_buffer_host(
            base_addr=base, offsets=offsets, rank_idx=g.rank, num_max_ranks=g.world_size
        )
        cells = combine_view(shared_ws, cells_at, g)

        def tensor(spec: ArgSpec) -> Any:
            t = weights_by_name.get(spec.name)
            return cute_tensor(cutlass_torch, staging[spec.name] if t is None else t, spec)

        def pointer(name: str) -> Any:
            t = local_ws if name == "local_workspace" else shared_ws
            return cute.runtime.make_ptr(
                cutlass.Uint8, t.data_ptr(), AddressSpace.gmem, assumed_align=16
            )

        args = call_args(
            g,
            tensor=tensor,
            pointer=pointer,
            peer_map=peer_map,
            stream=current_stream(dev),
            max_active_clusters=clusters,
        )
        compiled, launch_args, self._weight_args = compile_collective(
            kernel, args, self.runtime, per_layer=tuple(weights_by_name)
        )
        return _Compiled(
            compiled, local_ws, shared_ws, staging, peer_map, launch_args, combine=cells
        )

    def _build_weight_args(self) -> dict[str, Any]:
        """This layer's weights as kernel arguments, converted as `_compile` converts the
        compiling layer's (a layer that shares a pooled entry launches with its own)."""
        import cutlass.torch as cutlass_torch

        specs = {s.name: s for s in tensor_specs(self.geometry)}
        return {
            name: cute_tensor(cutlass_torch, t, specs[name])
            for name, t in _weights_by_name(self.prepared).items()
        }

    def _launch(self, entry: _Compiled) -> None:
        """Run the compiled kernel with this layer's weights on the current stream."""
        entry.compiled(**self._launch_args(entry))


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def symmetric_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeroed `shape` / `dtype` tensor on the NVSHMEM symmetric heap (collective), allocated
    as bytes and viewed as `dtype`: nvshmem4py sizes allocations from its own dtype table,
    which older releases lack fp8 in (the drop's runner allocates fp8 the same way).
    `nvshmem.core.free_tensor` frees it (same data pointer)."""
    import nvshmem.core
    import torch

    t = nvshmem.core.tensor((_nbytes(shape, dtype),), dtype=torch.uint8)
    t.zero_()
    return t.view(dtype).view(shape)


def _staging_specs(g: PullGeometry) -> tuple[ArgSpec, ...]:
    names = ("activation", "activation_sf", "topk_idx", "topk_weights", "output_activation")
    return tuple(s for s in tensor_specs(g) if s.name in names)


def _weights_by_name(prepared: Any) -> dict[str, torch.Tensor]:
    """The four weight tensor arguments of a layer's prepared weights, by argument name."""
    return {
        "fc1_weight": prepared.w13,
        "fc1_weight_sf": prepared.w13_scales,
        "fc2_weight": prepared.w2,
        "fc2_weight_sf": prepared.w2_scales,
    }


def combine_region(kernel: Any, g: PullGeometry) -> tuple[int, int]:
    """(byte offset, byte count) of the drop kernel's bf16 combine cells `[T, k, H]` in its
    shared workspace; `RuntimeError` if its region table no longer has them so."""
    return _combine_region(kernel, COMBINE_REGION, g, owner="moe_ep_sm90")

"""What the two sm100 CuTe DSL kernels (nvfp4, mxfp8) share beyond core's CuTe DSL base.

Warning:
    NEVER RUN ON A GPU (no Blackwell machine was available). `_compile`, `_launch` and
    `destroy` (CuTe DSL compile, NVSHMEM symmetric buffers, peer offsets, the launch) run on
    CPU only with recording fakes of cutlass, NVSHMEM and cuda-bindings, every call compared
    with the drop's own runners (`tests/backends/test_sm100_launch_glue.py`); the rest of
    the lifecycle (pooling, ref-counted release, staging copies, output copy-out, errors) is
    tested with `_compile` and `_launch` faked (`tests/backends/test_sm100_lifecycle.py`).

Lifecycle (core's `moe_ep.backends.support.cutedsl_kernel.CutedslMegaKernel`, shared with
`moe_ep_sm90.pull_cutedsl`): weights are prepared once in
`__init__`; the first `warmup()` (with `config.top_k` set) or the first forward compiles the
kernel for (config, geometry, device) and allocates its workspaces, symmetric staging
buffers and output buffer; layers of identical geometry share that entry through a
ref-counted `WorkspacePool`; the last `destroy()` frees the symmetric buffers after a
barrier. The kernel is built by `nvfp4_args.build_kernel` / `mxfp8_args.build_kernel` and
called with their `call_args`, the functions the compile-only check uses too.

Per launch, beyond the drop's own runners (which launch once, on the stream they compiled
on, with no padded slot): the kernel runs on the stream current at the launch (staging and
copy-out are issued there), and the combine cells of padded slots are zeroed first (see
`clear_padded_cells`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moe_ep.backends.support.cute_launch import combine_region as _combine_region
from moe_ep.backends.support.cutedsl_kernel import (
    CompiledEntry,
    CutedslMegaKernel,
    free_entry,
    raw_workspace_pointers,
)
from moe_ep.backends.support.hardware import check_availability
from moe_ep.backends.support.pool import WorkspacePool
from moe_ep.checks import PackShape
from moe_ep.contract import RuntimeRequirements
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm100.common import check_sm100_pack
from moe_ep_sm100.drops import CUTEDSL_DROP
from moe_ep_sm100.nvfp4_args import Geometry

__all__ = [
    "COMBINE_REGION",
    "CUTEDSL_PACKAGES",
    "POOL",
    "Sm100CutedslKernel",
    "combine_region",
    "raw_workspace_pointers",
]

CUTEDSL_PACKAGES = (
    ("cutlass", "nvidia-cutlass-dsl"),
    ("cuda.bindings", "cuda-bindings"),
    ("nvshmem", "nvshmem4py-cu13"),
    ("triton", "triton"),
)

COMBINE_REGION = "combine_quant"
"""The drop kernels' shared-workspace region of per-(token, slot) combine cells."""

POOL: WorkspacePool[CompiledEntry] = WorkspacePool(free=free_entry)


class Sm100CutedslKernel(CutedslMegaKernel):
    """Base of the two sm100 CuTe DSL kernels: availability, pack checks, pool; the
    lifecycle is core's `CutedslMegaKernel`. The output is local: with the separate top-k
    reduce, peers write the kernel's own staging in the shared workspace, and the local
    reduce writes `output_activation` (the drop's runners do the same).
    """

    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=True)
    pool: ClassVar[WorkspacePool[CompiledEntry]] = POOL
    payload_dtype: ClassVar[torch.dtype]
    """The payload dtype of a pre-quantized pack (uint8: packed fp4)."""

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return check_availability(
            capability=(10, 0),
            arch_label="Blackwell B200/GB200, sm_100a",
            packages=CUTEDSL_PACKAGES,
            drop=CUTEDSL_DROP,
        )

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: pack shapes and geometry."""
        return check_sm100_pack(weights, fleet, world_size, config, payload_dtype=cls.payload_dtype)

    def _combine_region(self, kernel: Any, g: Geometry) -> tuple[int, int]:
        return combine_region(kernel, g)


def combine_region(kernel: Any, g: Geometry) -> tuple[int, int]:
    """(byte offset, byte count) of the drop kernel's bf16 combine cells `[T, k, H]` in its
    shared workspace (the region its separate top-k reduce sums over); `RuntimeError` if
    the drop's region table no longer has them so (`support.cute_launch.shared_region`)."""
    return _combine_region(kernel, COMBINE_REGION, g, owner="moe_ep_sm100")

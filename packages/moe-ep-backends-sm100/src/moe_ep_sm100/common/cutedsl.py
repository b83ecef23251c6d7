"""What the two sm100 CuTe DSL kernels (nvfp4, mxfp8) share beyond core's CuTe DSL base:
their drop (`sm100_cutedsl_megamoe`, `vendor/sm100_cutedsl_megamoe/src/`, reached only
through its package `__init__`), the kernel base class and its pool, the constructor
arguments both drop kernels take alike, and the compile-only check's fake tensors.

The drop puts its `src/` first on `sys.path` and imports generic top-level names (`common`,
`src`, ...), so it cannot share a process with the sm90 pull drop.

Warning:
    NEVER RUN ON A GPU (no Blackwell machine was available). `_compile`, `_launch` and
    `destroy` (CuTe DSL compile, NVSHMEM symmetric buffers, peer offsets, the launch) run on
    CPU only with recording fakes of cutlass, NVSHMEM and cuda-bindings, every call compared
    with the drop's own runners (`tests/backends/test_sm100_launch_glue.py`); the rest of
    the lifecycle (pooling, ref-counted release, staging copies, output copy-out, errors) is
    tested with `_compile` and `_launch` faked (`tests/backends/test_sm100_lifecycle.py`);
    config validation, availability, each kernel's weight preparation and input staging
    (`layout`) on CPU tensors, and the kernel compiled for sm_100a with the arguments its
    `args` builds (`compile`), the functions the launch uses.

Lifecycle (core's `moe_ep.backends.support.cutedsl.mega_kernel.CutedslMegaKernel`, shared
with the sm90 pull kernel): weights are prepared once in
`__init__`; the first `warmup()` (with `config.top_k` set) or the first forward compiles the
kernel for (config, geometry, device) and allocates its workspaces, symmetric staging
buffers and output buffer; layers of identical geometry share that entry through a
ref-counted `WorkspacePool`; the last `destroy()` frees the symmetric buffers after a
barrier. The kernel is built by each kernel's `args.build_kernel` and called with its
`call_args`, the functions the compile-only check uses too.

Per launch, beyond the drop's own runners (which launch once, on the stream they compiled
on, with no padded slot): the kernel runs on the stream current at the launch (staging and
copy-out are issued there), and the combine cells of padded slots are zeroed first (see
`clear_padded_cells`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import torch

from moe_ep.backends.support import drop_access
from moe_ep.backends.support.availability import check_availability
from moe_ep.backends.support.cutedsl.launch_glue import combine_region as _combine_region
from moe_ep.backends.support.cutedsl.mega_kernel import (
    CompiledEntry,
    CutedslMegaKernel,
    free_entry,
)
from moe_ep.backends.support.drop_access import DropRef
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
from moe_ep.backends.support.pooling.workspace_pool import WorkspacePool
from moe_ep.checks import PackShape
from moe_ep.contract import RuntimeRequirements
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm100.common.pack_check import check_sm100_pack

__all__ = [
    "COMBINE_REGION",
    "CUTEDSL_DROP",
    "CUTEDSL_FLOORS",
    "CUTEDSL_PACKAGES",
    "POOL",
    "Sm100CutedslKernel",
    "combine_region",
    "drop_src_module",
    "fake_tensor",
    "shared_ctor_kwargs",
]

CUTEDSL_DROP = DropRef(
    import_name="moe_ep_drop_sm100_cutedsl", dist="moe-ep-drop-sm100-cutedsl-megamoe"
)

drop_src_module = partial(drop_access.drop_src_module, needed_by=__name__)
"""`drop_src_module(drop, name)`: module `name` of the drop's `src/`, through its shim."""

CUTEDSL_PACKAGES = (
    ("cutlass", "nvidia-cutlass-dsl"),
    ("cuda.bindings", "cuda-bindings"),
    ("nvshmem", "nvshmem4py-cu13"),
    ("triton", "triton"),
)

CUTEDSL_FLOORS = (
    ("nvidia-cutlass-dsl", "4.8.0", "the sm100_cutedsl_megamoe drop (flashinfer-python 0.7.4)"),
)
"""Version floors of the drop's release (its wheel's `Requires-Dist`), refused below."""

COMBINE_REGION = "combine_quant"
"""The drop kernels' shared-workspace region of per-(token, slot) combine cells."""

POOL: WorkspacePool[CompiledEntry] = WorkspacePool(free=free_entry)


class Sm100CutedslKernel(CutedslMegaKernel):
    """Base of the sm100 CuTe DSL kernels: availability, pack checks, pool; the
    lifecycle is core's `CutedslMegaKernel` (`sm100_mxfp8_mxfp4_bf16_cutedsl`, from another
    drop, overrides the availability and the combine region). The output is local: with
    the separate top-k reduce, peers write the kernel's own staging in the shared
    workspace, and the local reduce writes `output_activation` (the drop's runners do the
    same).
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
            floors=CUTEDSL_FLOORS,
            drop=CUTEDSL_DROP,
        )

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: pack shapes and geometry."""
        return check_sm100_pack(weights, fleet, world_size, config, payload_dtype=cls.payload_dtype)

    def _combine_region(self, kernel: Any, g: LaunchGeometry) -> tuple[int, int]:
        return combine_region(kernel, g)


def combine_region(kernel: Any, g: LaunchGeometry) -> tuple[int, int]:
    """(byte offset, byte count) of the drop kernel's bf16 combine cells `[T, k, H]` in its
    shared workspace (the region its separate top-k reduce sums over); `RuntimeError` if
    the drop's region table no longer has them so (`support.cutedsl.launch_glue.shared_region`)."""
    return _combine_region(kernel, COMBINE_REGION, g, owner="moe_ep_sm100")


def shared_ctor_kwargs(
    config: Any,
    g: LaunchGeometry,
    *,
    api: Any,
    mma_tiler_mnk: tuple[int, int, int],
    cluster_shape_mnk: tuple[int, int, int],
    use_2cta_instrs: bool,
    max_active_clusters: int,
) -> dict[str, Any]:
    """Constructor keyword arguments both sm100 CuTe DSL kernels of the drop take alike:
    static scheduling over `E_local` experts, the geometry, token-back by the epilogue warps,
    flag batching and the SwiGLU clamp. `api` carries the drop's padding blocks."""
    return dict(
        mma_tiler_mnk=mma_tiler_mnk,
        cluster_shape_mnk=cluster_shape_mnk,
        use_2cta_instrs=use_2cta_instrs,
        group_hint=max_active_clusters,
        token_padding_block=api.token_padding_block,
        sf_padding_block=api.sf_padding_block,
        load_balance_mode="static",
        static_expert_shape=(g.experts_per_rank, 2 * g.intermediate_size, g.hidden_size),
        force_static_sched=True,
        clc_bundle_size=None,
        num_sched_stages=None,
        world_size=g.world_size,
        num_topk=g.top_k,
        max_tokens_per_rank=g.max_tokens_per_rank,
        hidden=g.hidden_size,
        token_back_mode="epi_warps",
        epi_flag_batch=(1, 1),
        flag_batch=4,
        gate_up_clamp=config.gate_up_clamp,
    )


def fake_tensor(spec: ArgSpec) -> Any:
    """The compile-only check's fake gmem tensor of the kernel dtype for `spec`
    (`support.cutedsl.compile_fakes.fake_gmem_tensor`; imports cutlass)."""
    import cutlass

    from moe_ep.backends.support.cutedsl.compile_fakes import fake_gmem_tensor

    dtypes = {
        "fp4": cutlass.Float4E2M1FN,
        "fp8_e4m3": cutlass.Float8E4M3FN,
        "e8m0": cutlass.Float8E8M0FNU,
        "float32": cutlass.Float32,
        "int32": cutlass.Int32,
        "int64": cutlass.Int64,
        "bfloat16": cutlass.BFloat16,
        "uint8": cutlass.Uint8,
    }
    return fake_gmem_tensor(spec, dtypes[spec.dtype])

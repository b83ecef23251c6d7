"""Launch path shared by the two sm100 CuTe DSL kernels (nvfp4, mxfp8).

Warning:
    NEVER RUN ON A GPU (no Blackwell machine was available). `_compile`, `_launch` and
    `destroy` (CuTe DSL compile, NVSHMEM symmetric buffers, peer offsets, the launch) run on
    CPU only with recording fakes of cutlass, NVSHMEM and cuda-bindings, every call compared
    with the drop's own runners (`tests/backends/test_sm100_launch_glue.py`); the rest of
    the lifecycle (pooling, ref-counted release, staging copies, output copy-out, errors) is
    tested with `_compile` and `_launch` faked (`tests/backends/test_sm100_lifecycle.py`).

Lifecycle (the pattern of `moe_ep_sm90.pull_cutedsl`): weights are prepared once in
`__init__`; the first `warmup()` (with `config.top_k` set) or the first forward compiles the
kernel for (config, geometry, device) and allocates its workspaces, symmetric staging
buffers and output buffer; layers of identical geometry share that entry through a
ref-counted `WorkspacePool`; the last `destroy()` frees the symmetric buffers after a
barrier. The kernel's constructor and call arguments come from `nvfp4_args` / `mxfp8_args`,
the functions the compile-only check uses too.

Per launch, beyond the drop's own runners (which launch once, on the stream they compiled
on, with no padded slot): the kernel runs on the stream current at the launch (staging and
copy-out are issued there), and the combine cells of padded slots are zeroed first (see
`clear_padded_cells`).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from moe_ep.backends.support.args import check_pack_geometry
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
from moe_ep.checks import PackShape, check_weight_pack
from moe_ep.contract import RuntimeRequirements
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack
from moe_ep_sm100.drops import CUTEDSL_DROP
from moe_ep_sm100.nvfp4_args import ArgSpec, Geometry

__all__ = [
    "COMBINE_REGION",
    "CUTEDSL_PACKAGES",
    "SYMMETRIC_INPUTS",
    "CompiledEntry",
    "CutedslMegaKernel",
    "StagedBuffers",
    "check_sm100_pack",
    "combine_region",
    "kernel_tensor",
    "max_active_clusters",
    "storage_tensor",
]

CUTEDSL_PACKAGES = (
    ("cutlass", "nvidia-cutlass-dsl"),
    ("cuda.bindings", "cuda-bindings"),
    ("nvshmem", "nvshmem4py-cu13"),
    ("triton", "triton"),
)

# Staging buffers peers read (dispatch pulls them), so they live on the symmetric heap. The
# output is local: with the separate top-k reduce, peers write the kernel's own staging in
# the shared workspace, and the local reduce writes `output_activation` (the drop's runners
# do the same).
SYMMETRIC_INPUTS = ("activation", "activation_sf", "topk_idx", "topk_weights")
_STAGED = (*SYMMETRIC_INPUTS, "output_activation")

COMBINE_REGION = "combine_quant"
"""The drop kernels' shared-workspace region of per-(token, slot) combine cells."""


class StagedBuffers(Protocol):
    """What `stage_nvfp4_inputs` / `stage_mxfp8_inputs` return."""

    @property
    def activation(self) -> torch.Tensor: ...
    @property
    def activation_scales(self) -> torch.Tensor: ...
    @property
    def topk_ids(self) -> torch.Tensor: ...
    @property
    def topk_weights(self) -> torch.Tensor: ...
    @property
    def num_tokens(self) -> int: ...


def max_active_clusters(cluster_size: int) -> int:
    """Max co-resident clusters of `cluster_size` CTAs on this GPU (imports cutlass)."""
    import cutlass.utils as utils

    return int(utils.HardwareInfo().get_max_active_clusters(cluster_size))


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {
        "fp4": torch.float4_e2m1fn_x2,
        "fp8_e4m3": torch.float8_e4m3fn,
        "e8m0": torch.float8_e8m0fnu,
        "float32": torch.float32,
        "int64": torch.int64,
        "bfloat16": torch.bfloat16,
    }[name]


def storage_tensor(spec: ArgSpec, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A zeroed buffer for `spec`: `alloc(nbytes)` uint8 bytes viewed as the storage dtype.

    fp4 specs count logical elements; their storage packs two per byte along the leading
    dim (`float4_e2m1fn_x2`), as the drop's runners allocate them. NVSHMEM tensors support
    only a few dtypes, hence the byte allocation.
    """
    dtype, shape = _torch_dtype(spec.dtype), _storage_shape(spec)
    raw = alloc(storage_nbytes(spec))
    raw.zero_()
    return raw.view(dtype).reshape(shape)


def _storage_shape(spec: ArgSpec) -> list[int]:
    shape = list(spec.shape)
    if spec.dtype == "fp4":
        shape[spec.leading_dim] //= 2
    return shape


def storage_nbytes(spec: ArgSpec) -> int:
    """Bytes of `storage_tensor(spec, ...)` (fp4 packs two elements per byte)."""
    numel = 1
    for d in _storage_shape(spec):
        numel *= d
    return numel * _torch_dtype(spec.dtype).itemsize


def as_kernel_dtype(t: torch.Tensor, spec: ArgSpec) -> torch.Tensor:
    """`t` reinterpreted (same bytes, same strides) as the kernel's dtype for `spec`."""
    dtype = _torch_dtype(spec.dtype)
    if t.dtype == dtype:
        return t
    if t.dtype.itemsize != dtype.itemsize:
        raise MoeEpUsageError(
            f"{spec.name}: cannot reinterpret {t.dtype} as {dtype} (element sizes differ)"
        )
    return t.view(dtype)


def combine_region(kernel: Any, g: Geometry) -> tuple[int, int]:
    """(byte offset, byte count) of the drop kernel's bf16 combine cells `[T, k, H]` in its
    shared workspace (the region its separate top-k reduce sums over); `RuntimeError` if
    the drop's region table no longer has them so (`support.cute_launch.shared_region`)."""
    return _combine_region(kernel, COMBINE_REGION, g, owner="moe_ep_sm100")


def kernel_tensor(cutlass_torch: Any, t: torch.Tensor, spec: ArgSpec) -> Any:
    """`t` as the kernel argument `spec`: `from_dlpack` of its kernel-dtype view with the
    spec's alignment, layout dynamic with stride 1 on the spec's leading dim (the runners'
    `_to_cute`). `cutlass_torch` is the imported `cutlass.torch`."""
    return cute_tensor(cutlass_torch, as_kernel_dtype(t, spec), spec)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    import torch

    if dst.dtype.itemsize == 1 and src.dtype.itemsize == 1:
        dst.view(torch.uint8).copy_(src.view(torch.uint8))
    else:
        dst.copy_(src)


@dataclass
class CompiledEntry:
    """One compiled kernel with its workspaces and staging buffers (pooled across layers).

    `staging`: the symmetric `SYMMETRIC_INPUTS` and the local `output_activation`, in the
    kernel's dtypes; `symmetric`: the NVSHMEM tensors to free (staging inputs + the shared
    workspace); `launch_args`: the call's keyword arguments except `stream` and the weights
    (each launch passes the stream current then and its layer's own); `combine`: the
    `[T, k, H]` bf16 combine cells inside
    the shared workspace (`combine_region`); `staged_by`: the `StagedCall` whose inputs the
    staging buffers hold (layers sharing the entry overwrite each other's).
    """

    compiled: Any
    local_workspace: torch.Tensor
    shared_workspace: torch.Tensor
    staging: dict[str, torch.Tensor]
    symmetric: tuple[torch.Tensor, ...]
    launch_args: dict[str, Any]
    combine: torch.Tensor | None = None
    staged_by: Any = None


def _free(entry: CompiledEntry) -> None:
    import nvshmem.core

    for t in entry.symmetric:
        nvshmem.core.free_tensor(t)


POOL: WorkspacePool[CompiledEntry] = WorkspacePool(free=_free)


def check_sm100_pack(
    weights: MoEWeightPack,
    fleet: FleetParams,
    world_size: int,
    config: Any,
    *,
    payload_dtype: torch.dtype,
) -> PackShape:
    """Local checks of a `MoEWeightPack` before any collective: the generic pack checks
    (`check_weight_pack`; a pre-quantized payload must be `payload_dtype`, uint8 being
    packed fp4) and the geometry against `config.check_problem` (top_k from the config,
    else 1)."""
    shape = check_weight_pack(weights, fleet, world_size, quantized_dtypes=(payload_dtype,))
    check_pack_geometry(
        config,
        fleet,
        world_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
    )
    return shape


class CutedslMegaKernel(PooledKernel):
    """Base of the two sm100 CuTe DSL kernels: lifecycle, pooling, staging, launch.

    Subclasses provide the weight preparation, the input stager, the tensor specs and the
    kernel construction (`_make_kernel`, `_workspace_arg`).
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

    # -- subclass hooks -----------------------------------------------------------------
    @abstractmethod
    def _stage(self, tensors: MoEEpTensors, max_tokens: int) -> StagedBuffers:
        """Quantized, padded inputs of T rows (the layout module's stager)."""

    @abstractmethod
    def _tensor_specs(self, g: Geometry) -> tuple[ArgSpec, ...]:
        """The kernel's tensor arguments (`nvfp4_args` / `mxfp8_args.tensor_specs`)."""

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """Tensor arguments that are not staging buffers, by argument name (the four weight
        and scale tensors; a kernel with more extends this)."""
        p = self.prepared
        return {
            "fc1_weight": p.w13,
            "fc1_weight_sf": p.w13_scales,
            "fc2_weight": p.w2,
            "fc2_weight_sf": p.w2_scales,
        }

    def _check_workspace_sizes(self, g: Geometry, local_bytes: int, shared_bytes: int) -> None:
        """Refuse workspaces the kernel cannot address (default: none). Runs on every rank
        with the same sizes before anything is allocated, so all ranks raise alike."""

    @abstractmethod
    def _make_kernel(self, g: Geometry) -> tuple[Any, Any, int]:
        """(drop kernel instance, drop api, max active clusters); imports cutlass."""

    @abstractmethod
    def _call_args(
        self, g: Geometry, workspaces: tuple[torch.Tensor, torch.Tensor], common: dict[str, Any]
    ) -> dict[str, Any]:
        """Keyword arguments of the kernel's `__call__` via the args module's `call_args`:
        `common` holds its `tensor`, `peer_map`, `stream` and `max_active_clusters`; the
        subclass passes the (local, shared) workspaces the way its kernel takes them."""

    # -- MegaKernel ---------------------------------------------------------------------
    def stage_inputs(self, *, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Quantize this rank's inputs and copy them into the pooled symmetric buffers."""
        g = self._ensure_geometry(tensors.topk_ids.shape[1])
        staged = self._stage(tensors, g.max_tokens_per_rank)
        entry: CompiledEntry = self._entry()
        buf = entry.staging
        _copy_bytes(buf["activation"], staged.activation)
        _copy_bytes(buf["activation_sf"], staged.activation_scales)
        buf["topk_idx"].copy_(staged.topk_ids)
        buf["topk_weights"].copy_(staged.topk_weights)
        return self._hold_staging(entry, StagedCall(staged, output))

    def compute_staged(self, *, staged: Any) -> torch.Tensor:
        """Launch on the staged buffers; copies the live rows of the output out.

        `staged` must be the last `stage_inputs` of any layer sharing this pooled entry
        (their staging buffers are one set): `MoeEpUsageError` otherwise.
        """
        entry: CompiledEntry = self._entry()
        self._take_staging(entry, staged)
        n = staged.inputs.num_tokens
        if entry.combine is not None:
            clear_padded_cells(entry.combine, entry.staging["topk_idx"], n)
        self._launch(entry)
        staged.output[:n].copy_(entry.staging["output_activation"][:n])
        return staged.output

    # -- internals ----------------------------------------------------------------------
    def _compile(self, g: Geometry) -> CompiledEntry:
        """Build, allocate and compile (GPU only; never run on one; rehearsed on CPU with
        recording fakes of cutlass, NVSHMEM and cuda-bindings)."""
        import cutlass.torch as cutlass_torch
        import nvshmem.core
        import torch

        dev = self.runtime.device
        kernel, api, clusters = self._make_kernel(g)
        cells_at = combine_region(kernel, g)  # the drop still has the cells we clear
        local_bytes, shared_bytes = kernel.get_workspace_sizes()
        self._check_workspace_sizes(g, local_bytes, shared_bytes)
        specs = {s.name: s for s in self._tensor_specs(g)}
        sym_sizes = {name: storage_nbytes(specs[name]) for name in SYMMETRIC_INPUTS}
        check_symmetric_heap(self.kernel_name, {"shared workspace": shared_bytes, **sym_sizes})
        local_ws = torch.zeros((local_bytes,), dtype=torch.uint8, device=dev)
        shared_ws = nvshmem.core.tensor((shared_bytes,), dtype=torch.uint8)
        shared_ws.zero_()
        symmetric = [shared_ws]

        def sym_alloc(nbytes: int) -> torch.Tensor:
            t = nvshmem.core.tensor((nbytes,), dtype=torch.uint8)
            symmetric.append(t)
            return t

        def local_alloc(nbytes: int) -> torch.Tensor:
            return torch.empty((nbytes,), dtype=torch.uint8, device=dev)

        staging = {
            name: storage_tensor(
                specs[name], sym_alloc if name in SYMMETRIC_INPUTS else local_alloc
            )
            for name in _STAGED
        }
        staging["topk_idx"].fill_(-1)
        weights = self._weight_tensors()
        base = int(shared_ws.data_ptr())
        offsets = peer_offsets(shared_ws, g.world_size, g.rank)
        peer_map = api.sym_buffer_host(
            base_addr=base, offsets=offsets, rank_idx=g.rank, num_max_ranks=g.world_size
        )
        cells = combine_view(shared_ws, cells_at, g)

        def tensor(spec: ArgSpec) -> Any:
            t = staging[spec.name] if spec.name in staging else weights[spec.name]
            return kernel_tensor(cutlass_torch, t, spec)

        common = dict(
            tensor=tensor,
            peer_map=peer_map,
            stream=current_stream(dev),
            max_active_clusters=clusters,
        )
        args = self._call_args(g, (local_ws, shared_ws), common)
        compiled, launch_args, self._weight_args = compile_collective(
            kernel, args, self.runtime, per_layer=tuple(weights)
        )
        return CompiledEntry(
            compiled, local_ws, shared_ws, staging, tuple(symmetric), launch_args, cells
        )

    def _build_weight_args(self) -> dict[str, Any]:
        """This layer's weight arguments (cute tensors of its own prepared weights, built as
        the compile built the compiling layer's). Layers sharing a pooled entry share its
        compiled kernel and buffers, never its weights."""
        import cutlass.torch as cutlass_torch

        specs = {s.name: s for s in self._tensor_specs(self.geometry)}
        return {
            name: kernel_tensor(cutlass_torch, t, specs[name])
            for name, t in self._weight_tensors().items()
        }

    def _launch(self, entry: CompiledEntry) -> None:
        """Run the compiled kernel with this layer's weights on the current stream, where
        staging was issued (the stream at compile time may be another one: warmup on the
        default stream, forwards on a framework's stream or under graph capture)."""
        entry.compiled(**self._launch_args(entry))

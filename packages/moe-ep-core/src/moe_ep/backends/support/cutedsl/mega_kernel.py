"""The CuTe DSL mega-kernel lifecycle, once for every CuTe DSL kernel (sm90 pull, sm100
nvfp4 / mxfp8): staging, compute, compile, launch, the compiled-entry record, the free.

A subclass supplies its drop: `_make_kernel` (the drop kernel, built by the one function
its compile-only check uses too), `_tensor_specs`, `_stage`, `_call_args`,
`_combine_region`, and optionally `_weight_tensors`, `_local_tensors`,
`_check_workspace_sizes`. Never run on a GPU: rehearsed on CPU with recording fakes of
cutlass, NVSHMEM and cuda-bindings (tests/backends/*launch_glue*).

Staging buffers peers read (dispatch pulls them) live on the symmetric heap
(`symmetric_staging`); the rest are local.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from moe_ep.backends.support.cutedsl.kernel_cache import kernel_cache_root, launch_arch
from moe_ep.backends.support.cutedsl.launch_glue import (
    check_symmetric_heap,
    clear_padded_cells,
    combine_view,
    current_stream,
    cute_tensor,
    peer_offsets,
)
from moe_ep.backends.support.pooling.pooled_kernel import (
    KernelCacheUse,
    PooledKernel,
    StagedCall,
    compile_collective,
)
from moe_ep.errors import MoeEpUsageError

if TYPE_CHECKING:
    import torch

    from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
    from moe_ep.types import MoEEpTensors

__all__ = [
    "STAGED",
    "CompiledEntry",
    "CutedslMegaKernel",
    "StagedBuffers",
    "as_kernel_dtype",
    "free_entry",
    "kernel_tensor",
    "max_active_clusters",
    "raw_workspace_pointers",
    "storage_nbytes",
    "storage_tensor",
]

STAGED = ("activation", "activation_sf", "topk_idx", "topk_weights", "output_activation")
"""The staging buffers of every CuTe DSL mega-kernel (kernel argument names)."""

# ArgSpec dtype names that are not torch attribute names (the sm100 args vocabulary).
_DTYPE_ALIASES = {"fp4": "float4_e2m1fn_x2", "fp8_e4m3": "float8_e4m3fn", "e8m0": "float8_e8m0fnu"}


class StagedBuffers(Protocol):
    """What a kernel's stager returns (`stage_pull_inputs`, `stage_nvfp4_inputs`, ...)."""

    @property
    def activation(self) -> torch.Tensor: ...
    @property
    def activation_scales(self) -> torch.Tensor | None: ...
    @property
    def topk_ids(self) -> torch.Tensor: ...
    @property
    def topk_weights(self) -> torch.Tensor: ...
    @property
    def num_tokens(self) -> int: ...


def max_active_clusters(
    cluster_shape_mnk: tuple[int, int, int], *, sm_count: int | None = None
) -> int:
    """Max co-resident clusters of `cluster_shape_mnk` CTAs, the budget a kernel is built
    with: on this GPU (cutlass' `HardwareInfo`, as the drops' runners ask), or, for a
    compile-only check without a GPU, `sm_count // cluster size` (one CTA per SM). The
    launch and the compile-only check both size their kernel here."""
    cm, cn, ck = cluster_shape_mnk
    size = cm * cn * ck
    if sm_count is not None:
        return sm_count // size
    import cutlass.utils as utils

    return int(utils.HardwareInfo().get_max_active_clusters(size))


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, _DTYPE_ALIASES.get(name, name))
    assert isinstance(dtype, torch.dtype), name
    return dtype


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


def storage_tensor(spec: ArgSpec, alloc: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A zeroed buffer for `spec`: `alloc(nbytes)` uint8 bytes viewed as the storage dtype.

    fp4 specs count logical elements; their storage packs two per byte along the leading
    dim (`float4_e2m1fn_x2`), as the drops' runners allocate them. NVSHMEM tensors support
    only a few dtypes (older nvshmem4py releases lack fp8), hence the byte allocation.
    """
    raw = alloc(storage_nbytes(spec))
    raw.zero_()
    return raw.view(_torch_dtype(spec.dtype)).reshape(_storage_shape(spec))


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

    `staging`: the `STAGED` buffers in the kernel's dtypes, plus the kernel's local extra
    tensors (`_local_tensors`); `symmetric`: the NVSHMEM tensors to free (the symmetric
    staging buffers and the shared workspace); `launch_args`: the call's keyword arguments
    except `stream` and the weights (each launch passes the stream current then and its
    layer's own); `combine`: the `[T, k, H]` bf16 combine cells inside the shared workspace
    (`combine_region`); `staged_by`: the `StagedCall` whose inputs the staging buffers
    hold (layers sharing the entry overwrite each other's).
    """

    compiled: Any
    local_workspace: torch.Tensor
    shared_workspace: torch.Tensor
    staging: dict[str, torch.Tensor]
    symmetric: tuple[torch.Tensor, ...]
    peer_map: Any
    launch_args: dict[str, Any]
    combine: torch.Tensor | None = None
    staged_by: Any = None


def free_entry(entry: CompiledEntry) -> None:
    """Free an entry's NVSHMEM tensors (the pool calls this after the last destroy's
    device sync and barrier)."""
    import nvshmem.core

    for t in entry.symmetric:
        nvshmem.core.free_tensor(t)


class CutedslMegaKernel(PooledKernel):
    """Base of the CuTe DSL mega-kernels: pooled compile, staging, launch, free."""

    symmetric_staging: ClassVar[tuple[str, ...]] = STAGED[:4]
    """The staging buffers peers read; the others (the output, by default) are local."""

    # -- subclass hooks -----------------------------------------------------------------
    @abstractmethod
    def _make_kernel(self, g: LaunchGeometry) -> tuple[Any, Any, int]:
        """(drop kernel, drop api, max active clusters) for geometry `g`."""

    @abstractmethod
    def _tensor_specs(self, g: LaunchGeometry) -> tuple[ArgSpec, ...]:
        """The kernel's tensor arguments (the args module's `tensor_specs`)."""

    @abstractmethod
    def _stage(self, tensors: MoEEpTensors, max_tokens: int) -> StagedBuffers:
        """Quantized, padded inputs of `max_tokens` rows (the layout module's stager)."""

    @abstractmethod
    def _call_args(
        self, g: LaunchGeometry, workspaces: tuple[torch.Tensor, torch.Tensor], common: Any
    ) -> dict[str, Any]:
        """Keyword arguments of the kernel's `__call__` via the args module's `call_args`:
        `common` holds its `tensor`, `peer_map`, `stream` and `max_active_clusters`; the
        subclass passes the (local, shared) workspaces the way its kernel takes them."""

    @abstractmethod
    def _combine_region(self, kernel: Any, g: LaunchGeometry) -> tuple[int, int]:
        """(byte offset, byte count) of the drop kernel's combine cells (the launch module's
        `combine_region`, which the compile-only check calls too)."""

    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """Tensor arguments that are this layer's weights, by argument name (the four weight
        and scale tensors; a kernel with more extends this)."""
        p = self.prepared
        return {
            "fc1_weight": p.w13,
            "fc1_weight_sf": p.w13_scales,
            "fc2_weight": p.w2,
            "fc2_weight_sf": p.w2_scales,
        }

    def _local_tensors(self, g: LaunchGeometry, device: torch.device) -> dict[str, torch.Tensor]:
        """Pooled tensor arguments beyond the staging buffers (default: none)."""
        return {}

    def _check_workspace_sizes(
        self, g: LaunchGeometry, local_bytes: int, shared_bytes: int
    ) -> None:
        """Refuse workspaces the kernel cannot address (default: none). Runs on every rank
        with the same sizes before anything is allocated, so all ranks raise alike."""

    # -- MegaKernel ---------------------------------------------------------------------
    def stage_inputs(self, *, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Quantize this rank's inputs and copy them into the pooled staging buffers."""
        g = self._ensure_geometry(tensors.topk_ids.shape[1])
        staged = self._stage(tensors, g.max_tokens_per_rank)
        entry: CompiledEntry = self._entry()
        buf = entry.staging
        _copy_bytes(buf["activation"], staged.activation)
        if staged.activation_scales is not None:
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
    def _compile(self, g: LaunchGeometry) -> CompiledEntry:
        """Build, allocate and compile (collective; GPU only)."""
        import cutlass.torch as cutlass_torch
        import nvshmem.core
        import torch

        dev = self.runtime.device
        cache = self._cache_use(g)  # a refused cache directory raises before any allocation
        kernel, api, clusters = self._make_kernel(g)
        cells_at = self._combine_region(kernel, g)  # the drop still has the cells we clear
        local_bytes, shared_bytes = kernel.get_workspace_sizes()
        self._check_workspace_sizes(g, local_bytes, shared_bytes)
        specs = {s.name: s for s in self._tensor_specs(g)}
        sym_sizes = {name: storage_nbytes(specs[name]) for name in self.symmetric_staging}
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
                specs[name], sym_alloc if name in self.symmetric_staging else local_alloc
            )
            for name in STAGED
            if name in specs  # a kernel without an activation scale plane (bf16) has none
        }
        staging["topk_idx"].fill_(-1)
        staging.update(self._local_tensors(g, dev))
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
            kernel, args, self.runtime, per_layer=tuple(weights), cache=cache
        )
        return CompiledEntry(
            compiled,
            local_ws,
            shared_ws,
            staging,
            tuple(symmetric),
            peer_map,
            launch_args,
            combine=cells,
        )

    def _cache_use(self, g: LaunchGeometry) -> KernelCacheUse | None:
        """This rank's kernel-cache use when `MOE_EP_CUTEDSL_CACHE` is set, else None.

        Each rank has its own entry (the key holds the rank), so ranks never have to agree
        on hit or miss: nothing collective depends on it, and `compile_collective`'s
        bounded barrier waits for a rank that compiles while others load.
        """
        root = kernel_cache_root()
        if root is None:
            return None
        return KernelCacheUse(root, self.cfg, g, launch_arch(self.runtime.device))

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


def raw_workspace_pointers(workspaces: tuple[torch.Tensor, torch.Tensor]) -> Any:
    """`pointer(name)` for kernels that take their workspaces as raw gmem pointers (the
    sm90 pull and sm100 nvfp4 runners): 16-byte aligned `Uint8` pointers."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.typing import AddressSpace

    by_name = {"local_workspace": workspaces[0], "shared_workspace": workspaces[1]}

    def pointer(name: str) -> Any:
        return cute.runtime.make_ptr(
            cutlass.Uint8, by_name[name].data_ptr(), AddressSpace.gmem, assumed_align=16
        )

    return pointer

"""What the CuTe DSL mega kernels' launch paths share: peer offsets on the NVSHMEM heap, a
drop kernel's shared-workspace region, the padded slots' combine cells, kernel tensor
arguments and the current CUDA stream.

The drops' kernels (sm90 pull, sm100 nvfp4 / mxfp8) lay out their shared workspace from a
region table and sum every (token, slot) combine cell in a separate top-k reduce; a backend
passes its own kernel object, region name and specs in. Never run on a GPU: checked on CPU
against the drops' runners with recording fakes of cutlass, NVSHMEM and cuda-bindings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moe_ep.errors import MoeEpUsageError

if TYPE_CHECKING:
    import torch

    from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry

__all__ = [
    "check_symmetric_heap",
    "clear_padded_cells",
    "combine_region",
    "combine_view",
    "current_stream",
    "cute_tensor",
    "peer_offsets",
    "region_view",
    "shared_region",
]


def peer_offsets(symmetric: torch.Tensor, world_size: int, rank: int) -> tuple[int, ...]:
    """Byte offset from `symmetric`'s address to each PE's copy of it (0 for `rank`).

    Read off the peer buffer's base address (`nvshmem.core.get_peer_buffer`), not
    `get_peer_tensor`, whose `.view(shape)` fails when NVSHMEM reuses an address for a
    smaller allocation while nvshmem4py still tracks the larger peer buffer (FlashInfer's
    shim for these drops hit it; the pools free and reallocate workspaces as geometries
    come and go). The own rank is not looked up (nvshmem4py would hold a reference).
    """
    import nvshmem.core
    import torch
    from nvshmem.core.interop.torch import tensor_get_buffer

    base = int(symmetric.data_ptr())
    buf, _size, _dtype = tensor_get_buffer(symmetric)

    def peer_base(peer: int) -> int:
        peer_buf = nvshmem.core.get_peer_buffer(buf, peer)
        return int(torch.utils.dlpack.from_dlpack(peer_buf).data_ptr())

    return tuple(0 if peer == rank else peer_base(peer) - base for peer in range(world_size))


def check_symmetric_heap(kernel: str, what: dict[str, int]) -> None:
    """`MoeEpUsageError` before allocating when the symmetric buffers `what` (name -> bytes)
    need more than NVSHMEM's heap (`NVSHMEM_SYMMETRIC_SIZE`, read at initialisation, so it
    must be raised before the process starts). Every rank computes the same sizes, so all
    raise alike; NVSHMEM also keeps part of the heap for itself, so fitting here is
    necessary, not sufficient."""
    from moe_ep import env

    heap = env.nvshmem_symmetric_size()
    need = sum(what.values())
    if need > heap:
        parts = ", ".join(f"{k} {v}" for k, v in what.items())
        raise MoeEpUsageError(
            f"{kernel}: its symmetric buffers need {need} bytes ({parts}) but the NVSHMEM heap "
            f"is {heap} bytes (NVSHMEM_SYMMETRIC_SIZE, default 1g): start the processes with "
            f"NVSHMEM_SYMMETRIC_SIZE={-(-need * 5 // 4 // (1 << 20))}m or more, or lower "
            "max_tokens_per_rank"
        )


def shared_region(
    kernel: Any, name: str, shape: tuple[int, ...], *, bits: int, owner: str
) -> tuple[int, int]:
    """(byte offset, byte count) of region `name` in a drop kernel's shared workspace.

    Reads the kernel's region table (`_shared_offsets`, `_shared_region_by_name`, filled by
    its constructor). `RuntimeError` naming `owner` (the package that relies on it) if the
    drop no longer has that region with that `shape` of `bits`-bit elements.
    """
    try:
        offset = int(kernel._shared_offsets[name])
        spec = kernel._shared_region_by_name[name]
        got, width = tuple(int(d) for d in spec.shape), int(spec.cute_dtype.width)
    except (AttributeError, KeyError, TypeError) as exc:
        raise RuntimeError(
            f"the drop's kernel has no readable {name!r} shared-workspace region "
            f"({type(exc).__name__}: {exc}); {owner} must be updated for this drop"
        ) from exc
    if got != tuple(shape) or width != bits:
        raise RuntimeError(
            f"the drop's {name!r} region is {got} of {width}-bit elements; {owner} expects "
            f"{tuple(shape)} of {bits}-bit elements"
        )
    count = bits // 8
    for d in shape:
        count *= d
    return offset, count


def combine_region(kernel: Any, name: str, g: LaunchGeometry, *, owner: str) -> tuple[int, int]:
    """(byte offset, byte count) of a drop kernel's bf16 combine cells `[T, k, H]` (region
    `name`, which its separate top-k reduce sums over), checked by `shared_region`."""
    return shared_region(kernel, name, _combine_shape(g), bits=16, owner=owner)


def combine_view(
    shared_workspace: torch.Tensor, at: tuple[int, int], g: LaunchGeometry
) -> torch.Tensor:
    """`[T, k, H]` bf16 view of the combine cells at `at` (`combine_region`) inside the uint8
    shared workspace."""
    import torch

    return region_view(shared_workspace, *at, torch.bfloat16, _combine_shape(g))


def _combine_shape(g: LaunchGeometry) -> tuple[int, int, int]:
    return (g.max_tokens_per_rank, g.top_k, g.hidden_size)


def region_view(
    shared_workspace: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple
) -> torch.Tensor:
    """`[*shape]` `dtype` view of bytes `[offset, offset + nbytes)` of a uint8 workspace."""
    if offset + nbytes > shared_workspace.numel():
        raise RuntimeError(
            f"region [{offset}, {offset + nbytes}) lies outside the shared workspace of "
            f"{shared_workspace.numel()} bytes"
        )
    return shared_workspace[offset : offset + nbytes].view(dtype).view(shape)


def clear_padded_cells(cells: torch.Tensor, topk_idx: torch.Tensor, num_tokens: int) -> None:
    """Zero the combine cells `[T, k, H]` of the padded slots (`topk_idx == -1`) of the
    first `num_tokens` rows.

    The drops' dispatch skips a -1 slot, so no rank writes its cell, while their top-k
    reduce sums all k cells of every row: without this, a padded slot would add whatever an
    earlier launch (of this or another layer sharing the pooled workspace) left in its cell.
    Only the first launch finds the cells zeroed. Rows `>= num_tokens` are never copied out.
    No rank writes a padded slot's cell during a launch, so clearing it on the launch
    stream before the launch cannot race a peer.
    """
    n = num_tokens
    if n:
        cells[:n].masked_fill_((topk_idx[:n] < 0).unsqueeze(-1), 0)


def cute_tensor(cutlass_torch: Any, t: torch.Tensor, spec: ArgSpec) -> Any:
    """`t` as kernel argument `spec`: `from_dlpack` with the spec's alignment, layout dynamic
    with stride 1 on the spec's leading dim (the drops' runners' `_to_cute`).
    `cutlass_torch` is the imported `cutlass.torch`."""
    ct = cutlass_torch.from_dlpack(t, assumed_align=spec.align)
    return ct.mark_layout_dynamic(leading_dim=spec.leading_dim)


def current_stream(device: torch.device) -> Any:
    """`device`'s current CUDA stream as a `cuda.CUstream` (GPU only): each launch runs
    where its staging was issued (warmup may run on another stream than the forwards, e.g.
    a framework's stream or a graph capture)."""
    import cuda.bindings.driver as cuda
    import torch

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)

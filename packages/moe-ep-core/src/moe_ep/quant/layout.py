"""Scale-plane and weight layouts: 128x4 block swizzle, gate/up interleave, K-major views.

The 128x4 layout is the one block-scaled tensor-core GEMMs read (cuBLAS "1D block scaling
factors layout", CUTLASS Sm1xx block-scaled SF layout): a `[rows, cols]` scale plane (rows =
M or N, cols = K / block) is zero-padded to rows % 128 == 0 and cols % 4 == 0 and cut into
128x4 tiles, stored tile by tile (row tile major, column tile minor), 512 bytes each. Inside
a tile, scale (r, c) sits at offset `(r % 32) * 16 + (r // 32) * 4 + c`, i.e. the tile is
`[32 rows][4 row groups][4 cols]`.
"""

from __future__ import annotations

import torch

from moe_ep.errors import MoeEpUsageError

__all__ = [
    "GATE_UP_BLOCKS",
    "deinterleave_gate_up",
    "interleave_gate_up",
    "is_k_major",
    "k_major_view",
    "make_k_major",
    "swizzle_128x4",
    "swizzled_128x4_numel",
    "unswizzle_128x4",
]

GATE_UP_BLOCKS = (8, 16, 32)


def _ceil_to(v: int, m: int) -> int:
    return -(-v // m) * m


def swizzled_128x4_numel(rows: int, cols: int) -> int:
    """Elements of one swizzled plane: rows padded to 128 times cols padded to 4."""
    return _ceil_to(rows, 128) * _ceil_to(cols, 4)


def _check_plane(t: object, arg: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise MoeEpUsageError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    return t


def swizzle_128x4(scales: torch.Tensor) -> torch.Tensor:
    """Scale plane(s) `[..., rows, cols]` -> swizzled `[..., ceil128(rows) * ceil4(cols)]`.

    Any dtype (uint8 / e8m0 / e4m3 bytes, float32); padding is zero bytes. Leading dims (e.g.
    experts) are kept, each plane swizzled on its own. The result is contiguous.
    """
    _check_plane(scales, "scales")
    if scales.element_size() == 1 and scales.dtype not in (torch.uint8, torch.int8):
        # fp8 dtypes lack some fill / copy kernels on CPU: move the bytes instead.
        return swizzle_128x4(scales.view(torch.uint8)).view(scales.dtype)
    if scales.dim() < 2:
        raise MoeEpUsageError(f"scales must be [..., rows, cols], got shape {tuple(scales.shape)}")
    *lead, rows, cols = scales.shape
    rp, cp = _ceil_to(rows, 128), _ceil_to(cols, 4)
    padded = scales.new_zeros((*lead, rp, cp)) if (rp, cp) != (rows, cols) else scales
    if padded is not scales:
        padded[..., :rows, :cols] = scales
    tiles = padded.reshape(*lead, rp // 128, 4, 32, cp // 4, 4)
    nl = len(lead)
    # dims: rb, row group, r32, cb, c -> rb, cb, r32, row group, c
    perm = (*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    return tiles.permute(perm).contiguous().view(*lead, rp * cp)


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_128x4`: `[..., ceil128(rows) * ceil4(cols)]` -> `[..., rows, cols]`."""
    _check_plane(swizzled, "swizzled")
    for name, v in (("rows", rows), ("cols", cols)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise MoeEpUsageError(f"{name} must be a non-negative int, got {v!r}")
    rp, cp = _ceil_to(rows, 128), _ceil_to(cols, 4)
    if swizzled.dim() < 1 or swizzled.shape[-1] != rp * cp:
        raise MoeEpUsageError(
            f"swizzled must be [..., {rp * cp}] (rows {rows} padded to {rp} times cols {cols} "
            f"padded to {cp}), got shape {tuple(swizzled.shape)}"
        )
    if swizzled.element_size() == 1 and swizzled.dtype not in (torch.uint8, torch.int8):
        return unswizzle_128x4(swizzled.view(torch.uint8), rows, cols).view(swizzled.dtype)
    lead = tuple(swizzled.shape[:-1])
    nl = len(lead)
    tiles = swizzled.reshape(*lead, rp // 128, cp // 4, 32, 4, 4)
    # dims: rb, cb, r32, row group, c -> rb, row group, r32, cb, c
    perm = (*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    plane = tiles.permute(perm).reshape(*lead, rp, cp)
    return plane[..., :rows, :cols].contiguous()


def _gate_up_view(w13: torch.Tensor, block: int, dim: int, arg: str) -> tuple[int, int]:
    if not isinstance(w13, torch.Tensor):
        raise MoeEpUsageError(f"{arg} must be a torch.Tensor, got {type(w13).__name__}")
    if block not in GATE_UP_BLOCKS:
        raise MoeEpUsageError(f"block must be one of {GATE_UP_BLOCKS}, got {block!r}")
    if not -w13.dim() <= dim < w13.dim():
        raise MoeEpUsageError(f"dim {dim} out of range for {arg} of shape {tuple(w13.shape)}")
    d = dim % w13.dim()
    two_i = w13.shape[d]
    if two_i % (2 * block):
        raise MoeEpUsageError(
            f"{arg}.shape[{dim}] (2I) must be a multiple of 2 * block = {2 * block} so gate and "
            f"up halves split into blocks of {block}, got {two_i}"
        )
    return d, two_i // 2


def interleave_gate_up(w13: torch.Tensor, block: int, *, dim: int = -2) -> torch.Tensor:
    """Gate-then-up rows -> alternating blocks: g[0:b], u[0:b], g[b:2b], u[b:2b], ...

    Args:
        w13: `[..., 2I, ...]` with gate rows `[0, I)` then up rows `[I, 2I)` along `dim`
            (default -2: weights `[E, 2I, H]`, scale planes `[E, 2I, H/32]`); any dtype.
        block: rows per block, one of 8, 16, 32; I must be a multiple of it.

    Returns:
        A contiguous tensor of the same shape.
    """
    d, half = _gate_up_view(w13, block, dim, "w13")
    shape = w13.shape
    v = w13.reshape(*shape[:d], 2, half // block, block, *shape[d + 1 :])
    return v.transpose(d, d + 1).reshape(shape).contiguous()


def deinterleave_gate_up(w13: torch.Tensor, block: int, *, dim: int = -2) -> torch.Tensor:
    """Inverse of `interleave_gate_up`: alternating blocks -> gate rows then up rows."""
    d, half = _gate_up_view(w13, block, dim, "w13")
    shape = w13.shape
    v = w13.reshape(*shape[:d], half // block, 2, block, *shape[d + 1 :])
    return v.transpose(d, d + 1).reshape(shape).contiguous()


def k_major_view(w: torch.Tensor) -> torch.Tensor:
    """Weights stored `[..., N, K]` (K contiguous) -> the GEMM operand view `[..., K, N]`.

    The view shares storage; its K dim has stride 1 ("K-major" B operand).
    """
    if not isinstance(w, torch.Tensor) or w.dim() < 2:
        raise MoeEpUsageError("w must be a tensor [..., N, K]")
    if w.shape[-1] > 1 and w.stride(-1) != 1:
        raise MoeEpUsageError(
            f"w must have K (the last dim) contiguous, got strides {tuple(w.stride())} for "
            f"shape {tuple(w.shape)}; call .contiguous() first"
        )
    return w.transpose(-1, -2)


def is_k_major(b: torch.Tensor) -> bool:
    """Whether a GEMM operand `[..., K, N]` has K as its contiguous dim."""
    return b.dim() >= 2 and (b.shape[-2] <= 1 or b.stride(-2) == 1)


def make_k_major(b: torch.Tensor) -> torch.Tensor:
    """A `[..., K, N]` operand with K contiguous (copies only if it is not already)."""
    if b.dim() < 2:
        raise MoeEpUsageError(f"b must be [..., K, N], got shape {tuple(b.shape)}")
    if is_k_major(b):
        return b
    return b.transpose(-1, -2).contiguous().transpose(-1, -2)

"""The sm90 MXFP4 and NVFP4 pull kernels' physical weight tiles (both converters read
the same LDSM views, docs/backends.md): where each logical e2m1 code and exponent
offset sits in the bytes the drop's kernel reads (pure torch, CPU or CUDA), and back.

Read from the drop (`moe_hopper_fp8/mxfp4_cutedsl.py`, `kernel_mxfp4_fp8_glu_fc12_swapab.py`):
a K128 stage of packed codes is loaded with `ldmatrix` as if its bytes were an e4m3 WGMMA A
operand of K64, the loaded registers are re-read as e2m1 with the K mode nested `(2, K/2)`,
and `convert_mxfp4_pair_preprocessed_signs` turns each 32-bit word of 8 codes into 8 e4m3
bytes of the A fragment: byte t takes its exponent and mantissa from code t of the word
and its sign from code `SIGN_HOLDER[t]`. Written out on a `[N, K]` grid of codes, with
`n = 16G + 8a + r` and `k = 32g + 16b + 4c + q` (r < 8, c, q < 4, a, b < 2), the logical
code `(n, k)` lives at physical row `16G + 8b + r`, column `32g + 8c + 4a + q` (an e4m3
fragment's values span rows r and r+8 and columns +16, an `ldmatrix` register holds one
row), with the signs of each 8-code word permuted.

Offsets (one byte per row and K32 group) fold per 64 rows x 128 columns into a 16 x 16 byte
block (`make_expanded_offset_view`, the drop's `SmemLayoutWeightScaleExpanded`):
`folded[e, n // 64, k // 128, n % 16, 4 * (n // 16 % 4) + k // 32 % 4]`.

Never run on a GPU. Verified on CPU (`tests/backends/test_sm90_mxfp4_tile_fold.py`): a
thread-by-thread reading of the folded tiles (the A fragment, `ldmatrix`, the nested e2m1 K
mode, the drop's PTX interpreted, the expanded offsets) gives the portable twin's weights,
its layouts equal CuTe DSL's and the drop's as evaluated while tracing, and the round trip.
"""

from __future__ import annotations

import torch

from moe_ep import quant

__all__ = [
    "FOLD_BLOCK",
    "FOLD_K",
    "FOLD_M",
    "SIGN_HOLDER",
    "fold_codes",
    "fold_offsets",
    "unfold_codes",
    "unfold_offsets",
]

FOLD_M = 64
"""Weight rows per folded offset block (the drop's `MXFP4_FOLD_M`)."""
FOLD_K = 128
"""K elements per folded offset block (the drop's `MXFP4_K_TILE`)."""
FOLD_BLOCK = 16
"""A folded offset block is `FOLD_BLOCK x FOLD_BLOCK` bytes."""

SIGN_HOLDER = (1, 3, 5, 7, 0, 2, 4, 6)
"""Within a 32-bit word of 8 codes, the code whose bit 3 carries e4m3 byte t's sign: the PTX
ors `src & 0x80808080` (bit 3 of the odd codes) into bytes 0-3 and `(src << 4) & 0x80808080`
(bit 3 of the even codes) into bytes 4-7."""
_SIGN_OF = tuple(SIGN_HOLDER.index(t) for t in range(8))
"""Inverse: code t of a physical word carries the sign of logical code `_SIGN_OF[t]`."""


def _grid(codes: torch.Tensor) -> tuple[int, int, int]:
    e, n, k = (int(d) for d in codes.shape)
    if n % 16 or k % 32:
        raise ValueError(f"codes [E, N, K] need N % 16 == 0 and K % 32 == 0, got {(e, n, k)}")
    return e, n, k


def _move_codes(codes: torch.Tensor, *, to_physical: bool) -> torch.Tensor:
    """`[E, N, K]` codes moved between their logical and physical grid positions."""
    e, n, k = _grid(codes)
    # logical dims (E, G, a, r, g, b, c, q) <-> physical (E, G, b, r, g, c, a, q)
    if to_physical:
        v = codes.reshape(e, n // 16, 2, 8, k // 32, 2, 4, 4)
        return v.permute(0, 1, 5, 3, 4, 6, 2, 7).reshape(e, n, k)
    v = codes.reshape(e, n // 16, 2, 8, k // 32, 4, 2, 4)  # (E, G, b, r, g, c, a, q)
    return v.permute(0, 1, 6, 3, 4, 2, 5, 7).reshape(e, n, k)


def _move_signs(codes: torch.Tensor, holder: tuple[int, ...]) -> torch.Tensor:
    """Within each word of 8 codes: code t keeps its low 3 bits and takes bit 3 of code
    `holder[t]` (fold: `_SIGN_OF`; unfold: `SIGN_HOLDER`)."""
    words = codes.reshape(*codes.shape[:-1], -1, 8)
    signs = words[..., list(holder)] & 0x8
    return ((words & 0x7) | signs).reshape(codes.shape)


def fold_codes(packed: torch.Tensor) -> torch.Tensor:
    """Logical `[E, N, K/2]` packed e2m1 codes (N % 16, K % 32 == 0) -> the physical bytes,
    same shape, the kernel's `[E, K/2, N]` K-major weight once transposed."""
    codes = quant.unpack_e2m1(packed)
    physical = _move_signs(_move_codes(codes, to_physical=True), _SIGN_OF)
    return quant.pack_e2m1(physical.contiguous())


def unfold_codes(physical: torch.Tensor) -> torch.Tensor:
    """Inverse of `fold_codes`."""
    codes = _move_signs(quant.unpack_e2m1(physical), SIGN_HOLDER)
    return quant.pack_e2m1(_move_codes(codes, to_physical=False).contiguous())


def fold_offsets(offsets: torch.Tensor) -> torch.Tensor:
    """`[E, N, K/32]` offsets (N % 64, K % 128 == 0) -> `[E, N/64, K/128, 16, 16]` uint8."""
    e, n, groups = (int(d) for d in offsets.shape)
    if n % FOLD_M or groups % (FOLD_K // 32):
        raise ValueError(
            f"offsets [E, N, K/32] need N % {FOLD_M} == 0 and K % {FOLD_K} == 0, got "
            f"{(e, n, groups)}"
        )
    kb = groups // 4
    v = offsets.reshape(e, n // FOLD_M, 4, FOLD_BLOCK, kb, 4)  # (E, nb, m1, m0, kb, g)
    return v.permute(0, 1, 4, 3, 2, 5).reshape(e, n // FOLD_M, kb, FOLD_BLOCK, FOLD_BLOCK)


def unfold_offsets(folded: torch.Tensor) -> torch.Tensor:
    """Inverse of `fold_offsets`: `[E, N/64, K/128, 16, 16]` -> `[E, N, K/32]`."""
    e, nb, kb = (int(d) for d in folded.shape[:3])
    v = folded.reshape(e, nb, kb, FOLD_BLOCK, 4, 4)  # (E, nb, kb, m0, m1, g)
    return v.permute(0, 1, 4, 3, 2, 5).reshape(e, nb * FOLD_M, kb * 4)

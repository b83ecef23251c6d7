"""A few PTX integer instructions on int64 tensors of u32 words, for tests that run a drop's
converter PTX (read from its source) instruction by instruction on CPU."""

from __future__ import annotations

import torch

__all__ = ["prmt", "ptx_op"]

_M32 = 0xFFFFFFFF


def prmt(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """PTX `prmt.b32 d, a, b, c` (default mode): byte j of d is byte `c[4j+2:4j]` of {b, a},
    replicated from its sign bit when `c[4j+3]` is set."""
    a, b, c = (t.contiguous() for t in torch.broadcast_tensors(a, b, c))
    pool = a | (b << 32)
    out = torch.zeros_like(a)
    for j in range(4):
        sel = (c >> (4 * j)) & 0xF
        byte = (pool >> (8 * (sel & 7))) & 0xFF
        byte = torch.where((sel & 8) != 0, torch.where(byte >= 0x80, 0xFF, 0), byte)
        out |= byte << (8 * j)
    return out


def ptx_op(op: str, v: list[torch.Tensor | int]) -> torch.Tensor:
    """The u32 result of instruction `op` on source operands `v` (tensors or immediates)."""
    if op == "and.b32":
        r = v[0] & v[1]
    elif op == "or.b32":
        r = v[0] | v[1]
    elif op == "shr.u32":
        r = v[0] >> v[1]
    elif op == "shl.b32":
        r = v[0] << v[1]
    elif op == "mad.lo.u32":
        r = v[0] * v[1] + v[2]  # type: ignore[operator]
    elif op == "prmt.b32":
        r = prmt(*(torch.as_tensor(x) for x in v))
    else:
        raise AssertionError(f"PTX op {op} not modelled")
    return torch.as_tensor(r) & _M32

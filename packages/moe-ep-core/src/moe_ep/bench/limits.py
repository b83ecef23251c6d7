"""The limits a forward is measured against, each measured in the same run: the machine's
read bandwidth, dense GEMMs of the same useful FLOPs, the naive per-expert loop and a bare
`all_to_all_single` of the same bytes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

STREAM_BYTES = 1 << 30
"""Bytes read per measurement: far past any last-level cache (tens of MiB)."""


def read_bandwidth(reps: int, nbytes: int = STREAM_BYTES) -> list[float]:
    """Bytes per second of `reps` streaming reads (a `sum` over an fp32 buffer of `nbytes`,
    at torch's current intra-op thread count), one value per read."""
    buf = torch.ones(nbytes // 4)
    buf.sum()  # pages touched, threads started
    rates = []
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        rates.append(nbytes / (time.perf_counter() - start))
    return rates


def useful_flops(pairs: int, hidden: int, inter: int) -> int:
    """FLOPs of `pairs` (token, expert) pairs: FC1 `[H] x [H, 2I]` plus FC2 `[I] x [I, H]`,
    two per multiply-add."""
    return 6 * pairs * hidden * inter


def dense_gemms(
    pairs: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device | None = None
) -> Callable[[], object]:
    """Dense GEMMs doing `useful_flops(pairs, hidden, inter)`: `[pairs, H] @ [H, 2I]` and
    `[pairs, I] @ [I, H]` into preallocated outputs, the weights K-major as the layer keeps
    them. On CPU without bf16 GEMM kernels torch's bf16 mm is a slow fallback, so callers
    time fp32 too and take the faster as the machine's limit."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(pairs, hidden, generator=g).to(device=device, dtype=dtype)
    h = torch.randn(pairs, inter, generator=g).to(device=device, dtype=dtype)
    w13 = torch.randn(2 * inter, hidden, generator=g).to(device=device, dtype=dtype).t()
    w2 = torch.randn(hidden, inter, generator=g).to(device=device, dtype=dtype).t()
    gu = torch.empty(pairs, 2 * inter, dtype=dtype, device=device)
    y = torch.empty(pairs, hidden, dtype=dtype, device=device)
    return lambda: (torch.mm(x, w13, out=gu), torch.mm(h, w2, out=y))


def naive_forward(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The textbook loop with the layer's math: per expert gather, gate / up / down matmuls,
    SwiGLU in fp32 (rounded once to bf16), weighted fp32 index_add. `ids` index `w13 [E, 2I,
    H]` / `w2 [E, H, I]` (pairs routed elsewhere: ids outside `[0, E)` are skipped)."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        gate = xe @ w13[e, :inter].t()
        up = xe @ w13[e, inter:].t()
        y = (F.silu(gate.float()) * up.float()).bfloat16() @ w2[e].t()
        out.index_add_(0, tok, y.float() * weights[tok, slot].unsqueeze(1))
    return out.bfloat16()


def bare_all_to_all(group: Any, nbytes: int, world_size: int) -> Callable[[], object]:
    """One `all_to_all_single` moving `nbytes` per rank (rounded up to a multiple of the
    world size) over `group`: the communication limit of a forward moving as many bytes.
    Every rank must pass the same `nbytes` (e.g. a max over ranks)."""
    import torch.distributed as dist

    chunk = -(-nbytes // world_size)
    src = torch.zeros(chunk * world_size, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return lambda: dist.all_to_all_single(dst, src, group=group)

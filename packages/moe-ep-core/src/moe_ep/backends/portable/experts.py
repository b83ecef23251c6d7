"""Expert compute: grouped FC1 -> SwiGLU (optional clamp) -> requantize -> grouped FC2.

Rows arrive grouped by local expert (`counts [E_local]`). GEMMs use `torch._grouped_mm`
(int32 end offsets) where it applies (CPU bf16 / fp32; CUDA bf16 on sm_90+) and a per-expert
`mm` loop elsewhere. An expert's rows are the same matrix at every world size, so the bf16
result is bit-identical across world sizes given the same intra-op thread count (oneDNN may
split K across threads for large K).

The CUDA branch (`_grouped_mm` for bf16 on sm_90+) has never run on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from moe_ep.backends.portable.recipes import PreparedWeights

__all__ = ["grouped_mm", "run_experts"]

_SWIGLU_CHUNK_ROWS = 2048  # bounds the fp32 temporaries of SwiGLU


def _grouped_mm_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device.type == "cpu":
        return a.dtype in (torch.bfloat16, torch.float32)
    if a.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(a.device)
        return (
            a.dtype == torch.bfloat16 and major >= 9 and a.shape[1] % 8 == 0 and b.shape[2] % 8 == 0
        )
    return False


def grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`a [m, K]` rows grouped by `counts [G]` times `b [G, K, N]` -> `[m, N]` (a's dtype)."""
    m = int(a.shape[0])
    if m == 0:
        return a.new_empty((0, b.shape[2]))
    if _grouped_mm_applies(a, b):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_empty((m, b.shape[2]))
    start = 0
    for g, c in enumerate(counts.tolist()):
        if c:
            torch.mm(a[start : start + c], b[g], out=out[start : start + c])
        start += c
    return out


def run_experts(
    xs: list[torch.Tensor],
    counts: torch.Tensor,
    weights: PreparedWeights,
    requantize: Callable[[torch.Tensor], torch.Tensor],
    swiglu_clamp: float | None,
) -> torch.Tensor:
    """`xs = [x]`, `x [m, H]` (compute dtype, grouped by expert) -> `y [m, H]` bf16.

    x is popped from `xs` and freed after FC1 (a list, so the caller holds no reference).

    `[g; u] = x @ w13t`, `h = silu(g) * u` in fp32 (per-expert alpha13 applied to g and u
    first; clamp: g <= c, |u| <= c), FC2 input = `requantize(h)`, `y = h @ w2t` (times
    alpha2), cast to bf16.
    """
    x = xs.pop()
    m = int(x.shape[0])
    hidden = int(weights.w2t.shape[2])
    inter = int(weights.w2t.shape[1])
    if m == 0:
        return x.new_empty((0, hidden), dtype=torch.bfloat16)
    row_expert = None
    if weights.alpha13 is not None or weights.alpha2 is not None:
        row_expert = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts)
    gu = grouped_mm(x, weights.w13t, counts)
    device = x.device
    del x
    h = torch.empty((m, inter), dtype=weights.w2t.dtype, device=device)
    for s in range(0, m, _SWIGLU_CHUNK_ROWS):
        e = min(m, s + _SWIGLU_CHUNK_ROWS)
        g = gu[s:e, :inter].float()
        u = gu[s:e, inter:]
        if weights.alpha13 is not None and row_expert is not None:
            a = weights.alpha13[row_expert[s:e]].unsqueeze(1)
            g.mul_(a)
            u = u.float() * a
        if swiglu_clamp is not None:
            g.clamp_(max=swiglu_clamp)
            u = u.float().clamp(-swiglu_clamp, swiglu_clamp)
        F.silu(g, inplace=True)
        g.mul_(u)  # fp32 *= bf16/fp32, in place: h = silu(g) * u in fp32
        h[s:e].copy_(requantize(g))  # copy_ rounds to h's dtype (RNE) where needed
    del gu
    y = grouped_mm(h, weights.w2t, counts)
    if weights.alpha2 is not None and row_expert is not None:
        y = y.float() * weights.alpha2[row_expert].unsqueeze(1)
    return y.to(torch.bfloat16)

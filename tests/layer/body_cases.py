"""Shared helpers of the expert GEMM body tests (the dot and AMX orders): flushing as the
instructions do, bit comparisons, row groups, one `expert_gemm` call, and running a check at
one and two threads."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moe_ep.backends.portable import cpu_fused
from moe_ep.backends.portable.cpu_fused import ExpertGroups, StoredWeight

TINY = 2.0**-126  # fp32's smallest normal


def daz(v: torch.Tensor) -> torch.Tensor:
    """Subnormal -> zero of its sign (values exactly representable in the tensor's dtype)."""
    return torch.where(v.abs() < TINY, torch.zeros_like(v).copysign(v), v)


def chunk_pairs(x: torch.Tensor, w: torch.Tensor, flush: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 `x [Q, K]` and `w [N, K]` in float64, K zero-padded to whole 32-chunks (subnormals
    read as zero where `flush`), as `[Q, 1, chunks, 16, 2]` and `[1, N, chunks, 16, 2]`:
    element (c, p, e) is k = 32c + 2p + e."""
    q, k = x.shape
    k32 = -(-k // 32) * 32
    xp = torch.zeros(q, k32, dtype=torch.float64)
    wp = torch.zeros(int(w.shape[0]), k32, dtype=torch.float64)
    xp[:, :k], wp[:, :k] = x.double(), w.double()
    if flush:
        xp, wp = daz(xp), daz(wp)
    return xp.view(q, 1, k32 // 32, 16, 2), wp.view(1, -1, k32 // 32, 16, 2)


def differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many elements of a and b differ in their bits."""
    ia = a.view(torch.int16 if a.element_size() == 2 else torch.int32)
    return int((ia != b.view(ia.dtype)).sum())


def groups(counts: list[int], path: list[int] | None = None) -> ExpertGroups:
    """One group per expert, `counts[e]` rows each, in order; `path`: their path rows."""
    q_start = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    rows = None if path is None else torch.tensor(path, dtype=torch.int64)
    return ExpertGroups(q_start, torch.arange(len(counts)), q_start[:-1].clone(), rows)


def run(
    x: torch.Tensor,
    w: torch.Tensor | StoredWeight,
    counts: list[int],
    vector: bool | cpu_fused.Body,
    out_dtype: torch.dtype = torch.float32,
    path: list[int] | None = None,
    alpha: torch.Tensor | None = None,
) -> torch.Tensor:
    """`expert_gemm` of x's rows by groups `counts` on w (bf16 `[E, N, K]` or stored)."""
    g = groups(counts, path)
    stored = w if isinstance(w, StoredWeight) else StoredWeight(w, "bf16")
    out = torch.full((g.rows, stored.n), float("nan"), dtype=out_dtype)
    scratch = torch.empty(cpu_fused.expert_gemm_scratch(g.rows, stored.k))
    assert cpu_fused.expert_gemm(x, None, g, stored, out, scratch, vector=vector, alpha=alpha)
    return out


def at_one_and_two_threads(check: Callable[[int], None]) -> None:
    """`check(threads)` at 1 and 2 intra-op threads, the caller's count restored."""
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            check(threads)
    finally:
        torch.set_num_threads(before)


def bodies_match(
    x: torch.Tensor, w: torch.Tensor, counts: list[int], want: torch.Tensor,
    bodies: Sequence[bool | cpu_fused.Body],
) -> Callable[[int], None]:  # fmt: skip
    """A check for `at_one_and_two_threads`: each body gives `want`'s bits, fp32 and bf16."""

    def check(threads: int) -> None:
        for vector in bodies:
            assert differ(run(x, w, counts, vector), want) == 0, (vector, threads)
            got = run(x, w, counts, vector, torch.bfloat16)
            assert differ(got, want.bfloat16()) == 0, (vector, threads)

    return check

"""The expert GEMM's bf16 dot-product bodies: AVX-512 BF16 (`vdpbf16ps`) and its scalar twin.

The reference is a float64 emulation of the order cpu_fused.c documents for them, written
from the instruction's arithmetic as probed on AMD Zen 5 (Intel's SDM states the same): per
fp32 lane l of each 32-chunk, acc += x[2l+1] * w[2l+1], then acc += x[2l] * w[2l], each
product exact and each sum rounded once (RNE), fp32 subnormal inputs read as zero and
subnormal results flushed to zero; then the fixed pairwise reduction of the 16 lanes.
"""

from __future__ import annotations

import pytest
import torch
from body_cases import (
    TINY,
    at_one_and_two_threads,
    bodies_match,
    chunk_pairs,
    daz,
    differ,
    groups,
    run,
)  # fmt: skip

from moe_ep.backends.portable import cpu_fused
from moe_ep.backends.portable.cpu_fused import StoredWeight

pytestmark = pytest.mark.skipif(cpu_fused.library() is None, reason="no fused CPU library")

RAGGED = [0, 1, 2, 3, 4, 5, 8, 9, 17, 24, 25, 0, 97, 300, 1]
"""Rows per expert: empty experts, the 4-row tiles and their tails, the 24-row blocks, one
expert past a 96-row work item."""


def reference_dot(
    x: torch.Tensor, w: torch.Tensor, *, odd_first: bool = True, flush: bool = True
) -> torch.Tensor:
    """fp32 `[Q, N]` of bf16 `x [Q, K]` times bf16 `w [N, K]` in the dot order. `odd_first`
    and `flush` False plant the faults the tests show this comparison catches."""
    q, k32 = int(x.shape[0]), -(-int(x.shape[1]) // 32) * 32
    xs, ws = chunk_pairs(x, w, flush)
    acc = torch.zeros(q, int(w.shape[0]), 16, dtype=torch.float32)
    for c in range(k32 // 32):
        for e in (1, 0) if odd_first else (0, 1):
            # bf16 x bf16 is exact in float64, so only the sum rounds (twice, float64 then
            # fp32: a tie case these data miss, as in test_expert_gemm's _fma32)
            acc = (acc.double() + xs[:, :, c, :, e] * ws[:, :, c, :, e]).float()
            acc = daz(acc) if flush else acc
    t = acc[..., :8] + acc[..., 8:]
    u = t[..., :4] + t[..., 4:]
    v = u[..., :2] + u[..., 2:]
    return v[..., 0] + v[..., 1]


def _want(x: torch.Tensor, w: torch.Tensor, counts: list[int], **fault: bool) -> torch.Tensor:
    out, q0 = [], 0
    for e, rows in enumerate(counts):
        out.append(reference_dot(x[q0 : q0 + rows], w[e], **fault))
        q0 += rows
    return torch.cat(out)


def _bodies() -> list[cpu_fused.Body]:
    return ["bf16dot_scalar", *(["avx512bf16"] if cpu_fused.vector_bodies() & 8 else [])]


def _default_rows(counts: list[int]) -> torch.Tensor:
    """Which rows the default (vector=True) sums in the dot order where the CPU has AVX-512
    BF16 and no AMX: those of experts with more than 2 rows (smaller ones take the AVX2
    body; with AMX the AMX body, test_expert_gemm_amx.py)."""
    return torch.tensor([r > 2 for r in counts for _ in range(r)], dtype=torch.bool)


@pytest.mark.parametrize(("n", "k"), [(37, 19), (70, 1043), (9, 2048), (33, 64), (5, 31)])
def test_dot_bodies_match_the_emulation_at_one_and_two_threads(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(len(RAGGED), n, k, generator=g).bfloat16()
    x = torch.randn(sum(RAGGED), k, generator=g).bfloat16()
    want = _want(x, w, RAGGED)
    same = bodies_match(x, w, RAGGED, want, _bodies())

    def check(threads: int) -> None:
        same(threads)
        if cpu_fused.vector_bodies() & 24 == 8:  # AVX-512 BF16 without AMX
            got, dot = run(x, w, RAGGED, True), _default_rows(RAGGED)
            assert differ(got[dot], want[dot]) == 0, threads
            assert differ(got[~dot], run(x, w, RAGGED, "avx2")[~dot]) == 0, threads

    at_one_and_two_threads(check)
    # the comparison catches a pair taken in the other order (from the second chunk on: the
    # first pair's sum starts at +0, so its order cannot show) and the fp32-FMA order
    assert (differ(_want(x, w, RAGGED, odd_first=False), want) > 0) == (k > 32)
    assert differ(run(x, w, RAGGED, False), want) > 0


def test_subnormal_inputs_and_results_are_flushed_as_the_instruction_does() -> None:
    g = torch.Generator().manual_seed(5)
    counts, n, k = [3, 0, 6], 11, 77
    x = torch.randn(sum(counts), k, generator=g)
    # row 0: subnormal bf16 inputs only (2^-130.4 to 2^-127); times w ~ 2^10, normal products
    x[0] = x[0].sign() * (0.1 + 0.9 * torch.rand(k, generator=g)) * 2.0**-127
    x[1] = torch.where(torch.rand(k, generator=g) < 0.25, x[0], x[1])
    x[3:] *= 2.0**-63  # times w ~ 2^-64: products and sums below fp32's smallest normal
    w = torch.randn(len(counts), n, k, generator=g)
    w[0] *= 2.0**10
    w[2] *= 2.0**-64
    x, w = x.bfloat16(), w.bfloat16()
    assert ((x[0].float().abs() < TINY) & (x[0] != 0)).all()
    want = _want(x, w, counts)
    unflushed = _want(x, w, counts, flush=False)
    assert (want[0] == 0).all() and (unflushed[0] != 0).all()  # inputs read as zero
    assert differ(unflushed[3:], want[3:]) > 0  # subnormal results flushed
    for vector in _bodies():
        assert differ(run(x, w, counts, vector), want) == 0, vector


def test_dot_bodies_refuse_other_formats_and_a_missing_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    two, scratch = groups([2]), torch.empty(cpu_fused.expert_gemm_scratch(2, 32))
    bf16 = StoredWeight(torch.ones(1, 4, 32, dtype=torch.bfloat16), "bf16")
    e4m3 = StoredWeight(torch.full((1, 4, 32), 0x38, dtype=torch.uint8), "e4m3")
    out = torch.empty(2, 4)
    for x, w in ((torch.ones(2, 32), bf16), (torch.ones(2, 32).bfloat16(), e4m3)):
        with pytest.raises(ValueError, match=r"vector='bf16dot_scalar' needs bf16 x and bf16"):
            cpu_fused.expert_gemm(x, None, two, w, out, scratch, vector="bf16dot_scalar")
    monkeypatch.setattr(cpu_fused, "vector_bodies", lambda: 7)
    with pytest.raises(ValueError, match=r"vector='avx512bf16': this build or CPU lacks"):
        cpu_fused.expert_gemm(torch.ones(2, 32).bfloat16(), None, two, bf16, out, scratch,
                              vector="avx512bf16")  # fmt: skip

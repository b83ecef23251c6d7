"""The expert GEMM's vector bodies against each other: AVX-512F, AVX2 and the scalar twin.

Each body is also compared with the float64 emulation of the documented sum order in
test_expert_gemm.py; here every body and the default choice (AVX-512F with AVX2 for row
blocks of 1-2 rows) must give the scalar twin's bits on ragged groups, at 1 and 2 threads.
"""

from __future__ import annotations

import pytest
import torch

from moe_ep.backends.portable import cpu_fused
from moe_ep.backends.portable.cpu_fused import ExpertGroups, StoredWeight

pytestmark = pytest.mark.skipif(cpu_fused.library() is None, reason="no fused CPU library")

RAGGED = [0, 1, 2, 3, 4, 5, 8, 9, 17, 24, 25, 0, 97, 300, 1]
"""Rows per expert: empty experts, the AVX2 / AVX-512 row tiles (3 / 4) and their tails,
the 24-row blocks, and one expert past a 96-row work item."""


def _groups(counts: list[int]) -> ExpertGroups:
    q_start = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    return ExpertGroups(q_start, torch.arange(len(counts)), q_start[:-1].clone())


def _weight(code: str, n: int, k: int, g: torch.Generator) -> StoredWeight:
    e = len(RAGGED)
    if code == "bf16":
        return StoredWeight(torch.randn(e, n, k, generator=g).bfloat16(), "bf16")
    if code == "e4m3":
        codes = torch.randn(e, n, k, generator=g).to(torch.float8_e4m3fn).view(torch.uint8)
        scales = torch.randint(120, 135, (e, n, k // 32), dtype=torch.uint8, generator=g)
        return StoredWeight(codes, "e4m3", scales, "e8m0", 32)
    codes = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randn(e, n, k // 16, generator=g).abs().to(torch.float8_e4m3fn)
    return StoredWeight(codes, "e2m1", scales.view(torch.uint8), "e4m3", 16)


def _run(x: torch.Tensor, w: StoredWeight, vector: bool | cpu_fused.Body) -> torch.Tensor:
    groups = _groups(RAGGED)
    out = torch.full((groups.rows, w.n), float("nan"))
    scratch = torch.empty(cpu_fused.expert_gemm_scratch(groups.rows, w.k))
    assert cpu_fused.expert_gemm(x, None, groups, w, out, scratch, vector=vector)
    return out


@pytest.mark.parametrize(("code", "n", "k"), [("bf16", 37, 19), ("bf16", 70, 1043),
                                              ("bf16", 9, 2048), ("e4m3", 35, 288),
                                              ("e2m1", 66, 320)])  # fmt: skip
def test_every_body_and_thread_count_gives_the_scalar_twins_bits(code: str, n: int, k: int) -> None:
    if not cpu_fused.vector_bodies() & 4:
        pytest.skip("this CPU or build has no AVX-512F expert GEMM body")
    g = torch.Generator().manual_seed(n * 7 + k)
    w = _weight(code, n, k, g)
    x = torch.randn(sum(RAGGED), k, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = _run(x, w, False).view(torch.int32)
        assert not want.view(torch.float32).isnan().all(dim=1).any()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            # True: these bodies, except for bf16 experts of 3+ rows where the CPU has AVX-512
            # BF16 (the dot order, test_expert_gemm_bf16dot.py)
            dot_default = code == "bf16" and cpu_fused.vector_bodies() & 8
            for vector in ("avx512", "avx2", *(() if dot_default else (True,))):
                got = _run(x, w, vector).view(torch.int32)
                bad = (got != want).nonzero()
                assert bad.numel() == 0, f"{vector} at {threads} threads: {bad.shape[0]} differ"
    finally:
        torch.set_num_threads(before)


def test_a_body_this_build_or_cpu_lacks_or_an_unknown_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = StoredWeight(torch.ones(1, 4, 16, dtype=torch.bfloat16), "bf16")
    x, out = torch.ones(2, 16), torch.empty(2, 4)
    groups, scratch = _groups([2]), torch.empty(cpu_fused.expert_gemm_scratch(2, 16))
    with pytest.raises(ValueError, match=r"vector must be True, False or one of avx2, avx512, "):
        cpu_fused.expert_gemm(x, None, groups, w, out, scratch, vector="avx1024")  # type: ignore[arg-type]
    monkeypatch.setattr(cpu_fused, "vector_bodies", lambda: 0)
    for body in ("avx512", "avx2", "avx2kseq"):
        with pytest.raises(ValueError, match=f"vector='{body}': this build or CPU lacks"):
            cpu_fused.expert_gemm(x, None, groups, w, out, scratch, vector=body)  # type: ignore[arg-type]
    assert cpu_fused.expert_gemm(x, None, groups, w, out, scratch)  # True: the scalar twin
    assert torch.equal(out, torch.full((2, 4), 16.0))

"""The expert GEMM's k-order bodies: AVX2 with activation rows in the lanes, its scalar twin,
and both on weights packed in blocks of 16 columns (`cpu_fused.pack_k16`, bf16 values, and
`pack_k16_codes`, e4m3 codes with fp32 scales: the AVX2 body with the columns in the lanes).

The reference is the order's definition computed by torch: each output the fp32 sum of its
products in increasing k, left to right from +0. A bf16 x bf16 product is exact in fp32 (8 + 8
significand bits), so `acc + x_k * w_k` in fp32 rounds once per step, as the kernels' fused
multiply-add does (the data keep every product far from fp32's subnormal range, where the
two would part).
"""

from __future__ import annotations

import re

import pytest
import torch

from moe_ep.backends.portable import cpu_fused
from moe_ep.backends.portable.cpu_fused import ExpertGroups, PackedK16, StoredWeight

pytestmark = pytest.mark.skipif(cpu_fused.library() is None, reason="no fused CPU library")

RAGGED = [0, 1, 3, 8, 9, 12, 13, 16, 17, 0, 40, 97, 130, 300, 1]
"""Rows per expert: empty experts, the 8-row tail tile and the padded 16-row one on both sides
of the auto threshold (13), one expert past a 96-row work item, one of several."""


def _has_avx2() -> bool:
    return bool(cpu_fused.vector_bodies() & 1)


def reference_kseq(x: torch.Tensor, w: torch.Tensor, *, reverse: bool = False) -> torch.Tensor:
    """fp32 `[Q, N]` of bf16 `x [Q, K]` times bf16 `w [N, K]` in the k order; `reverse` sums
    from the last k instead (a planted fault the comparison must catch)."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(int(x.shape[0]), int(w.shape[0]))
    order = range(int(x.shape[1]))
    for e in reversed(order) if reverse else order:
        acc = acc + xf[:, e : e + 1] * wf[:, e]
    return acc


def _groups(counts: list[int], path: list[int] | None = None) -> ExpertGroups:
    q = torch.zeros(len(counts) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(counts, dtype=torch.int64), 0, out=q[1:])
    rows = None if path is None else torch.tensor(path, dtype=torch.int64)
    return ExpertGroups(q, torch.arange(len(counts), dtype=torch.int64), q[:-1].clone(), rows)


def _problem(
    counts: list[int], n: int, k: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(len(counts), n, k, generator=g).bfloat16()
    x = torch.randn(sum(counts) + 5, k, generator=g).bfloat16()
    rows = torch.randperm(sum(counts) + 5, generator=g)[: sum(counts)].contiguous()
    alpha = (torch.rand(len(counts), generator=g) + 0.5).float()
    return x, rows, w, alpha


def _run(
    x: torch.Tensor,
    rows: torch.Tensor,
    w: torch.Tensor,
    groups: ExpertGroups,
    vector: bool | cpu_fused.Body,
    out_dtype: torch.dtype,
    alpha: torch.Tensor | None,
    packed: bool = False,
) -> torch.Tensor:
    n, k = int(w.shape[1]), int(w.shape[2])
    out = torch.full((groups.rows, n), float("nan"), dtype=out_dtype)
    scratch = torch.empty(cpu_fused.expert_gemm_scratch(groups.rows, k))
    stored = cpu_fused.pack_k16(w) if packed else StoredWeight(w, "bf16")
    assert cpu_fused.expert_gemm(x, rows, groups, stored, out, scratch, alpha=alpha, vector=vector)
    return out


def _want(
    x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, counts: list[int], alpha: torch.Tensor
) -> torch.Tensor:
    parts, q = [], 0
    for e, c in enumerate(counts):
        parts.append(reference_kseq(x[rows[q : q + c]], w[e]) * alpha[e])
        q += c
    return torch.cat(parts)


def _bodies(packed: bool = False) -> list[bool | cpu_fused.Body]:
    """The bodies to test; on packed weights vector=True too (the k order at any rows)."""
    bodies: list[bool | cpu_fused.Body] = ["kseq_scalar", *([True] if packed else [])]
    return [*bodies, "avx2kseq"] if _has_avx2() else bodies


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize(
    ("n", "k"), [(5, 1), (7, 2), (50, 19), (97, 300), (13, 1043), (6, 2048), (33, 64)]
)
def test_every_body_matches_the_k_order_bit_for_bit(n: int, k: int, packed: bool) -> None:
    """Ragged groups (RAGGED: empty, 1-300 rows, tails of every row tile), N with and
    without a partial block of 16 columns, K with and without a partial chunk of 16."""
    x, rows, w, alpha = _problem(RAGGED, n, k, seed=k)
    want = _want(x, rows, w, RAGGED, alpha)
    groups = _groups(RAGGED)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for vector in _bodies(packed):
                got = _run(x, rows, w, groups, vector, torch.float32, alpha, packed)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
                    f"{vector} at {threads} threads, fp32 out: "
                    f"{int((got != want).sum())} of {want.numel()} differ"
                )
                got16 = _run(x, rows, w, groups, vector, torch.bfloat16, alpha, packed)
                assert torch.equal(got16.view(torch.int16), want.bfloat16().view(torch.int16))
    finally:
        torch.set_num_threads(before)


SPECIAL = [
    1.5,
    -1.5,
    1.0078125,
    3.0,
    float("nan"),
    float("inf"),
    float("-inf"),
    0.0,
    -0.0,
    3.3895313892515355e38,
    2.0**-70,
    -(2.0**-70),
    2.0**-75,
    0.5,
    7.0,
    1.0,
]
"""bf16 values whose products (K = 1) are rounding ties, NaN, infinities, overflow past bf16's
largest value (bf16 max x 1.0078125), signed zeros, fp32 subnormals (bf16 0 after rounding)
and a tie under fp32's smallest subnormal (2^-150). No product underflows with a sign: there
the fma's -0 and torch's rounded product plus +0 part (the module docstring)."""


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("alpha_on", [False, True])
def test_the_stores_round_special_values_as_torch(alpha_on: bool, packed: bool) -> None:
    """Each output's store (times alpha, then fp32 or bf16 by round-to-nearest-even, NaN
    quietened) equals torch's, for 16 x 16 products of special values: whole 8 x 8 blocks
    and, at N = 13, a partial one."""
    v = torch.tensor(SPECIAL).bfloat16()
    x = v[:, None].repeat(2, 1).contiguous()  # 32 rows: two 16-row blocks of every value
    for n in (16, 13):
        w = v.flip(0)[:n].reshape(1, n, 1).contiguous()
        groups = _groups([32])
        alpha = torch.tensor([0.75]) if alpha_on else None
        want = reference_kseq(x, w[0]) * (alpha[0] if alpha is not None else 1.0)
        bits = want.view(torch.int32)
        # torch's round to nearest even, and a NaN keeps its sign and top payload bits,
        # quietened (torch's vectorized cast writes 0xffff for every NaN instead)
        want16 = torch.where(
            want.isnan(), (bits >> 16) | 0x40, want.bfloat16().view(torch.int16).int()
        ).to(torch.int16)
        assert int(want.isnan().sum()) > 0 and int((want16 < 0).sum()) > 0
        for vector in _bodies(packed):
            got = _run(x, torch.arange(32), w, groups, vector, torch.float32, alpha, packed)
            assert torch.equal(got.view(torch.int32), bits), f"{vector} N={n}, fp32 out"
            got16 = _run(x, torch.arange(32), w, groups, vector, torch.bfloat16, alpha, packed)
            differ = int((got16.view(torch.int16) != want16).sum())
            assert differ == 0, f"{vector} N={n}, bf16 out: {differ} differ"


def test_the_comparison_sees_another_order() -> None:
    """The data tell the k order from the reversed one and from the 16-lane fp32 order."""
    counts = [16, 40]
    x, rows, w, alpha = _problem(counts, 24, 300, seed=3)
    groups = _groups(counts)
    want = _want(x, rows, w, counts, alpha)
    reversed_ = torch.cat(
        [reference_kseq(x[rows[:16]], w[0], reverse=True) * alpha[0],
         reference_kseq(x[rows[16:]], w[1], reverse=True) * alpha[1]]
    )  # fmt: skip
    assert not torch.equal(reversed_, want)
    lanes16 = _run(x, rows, w, groups, False, torch.float32, alpha)  # the fp32 order's twin
    assert not torch.equal(lanes16, want)
    assert torch.equal(_run(x, rows, w, groups, "kseq_scalar", torch.float32, alpha), want)


@pytest.mark.skipif(
    not cpu_fused.kseq_by_default(),
    reason="vector=True takes the k order only on AVX2 CPUs without AVX-512F",
)
def test_the_default_takes_the_k_order_by_path_rows() -> None:
    """vector=True: groups of KSEQ_ROWS+ path rows sum in the k order, smaller ones in the
    16-lane fp32 order; path_rows (a replica's logical expert's rows) decides, not the
    group's own rows."""
    t = cpu_fused.KSEQ_ROWS
    counts = [t - 1, t, 5, t + 4]
    x, rows, w, alpha = _problem(counts, 20, 100, seed=5)
    kseq = _run(x, rows, w, _groups(counts), "kseq_scalar", torch.float32, alpha)
    lanes = _run(x, rows, w, _groups(counts), False, torch.float32, alpha)
    starts = [0, t - 1, 2 * t - 1, 2 * t + 4, 3 * t + 8]

    def part(v: torch.Tensor, g: int) -> torch.Tensor:
        return v[starts[g] : starts[g + 1]]

    for path, picks in (
        (None, [False, True, False, True]),
        ([t - 1, t, t + 30, 1], [False, True, True, False]),
    ):
        got = _run(x, rows, w, _groups(counts, path), True, torch.float32, alpha)
        for g, k_order in enumerate(picks):
            want = part(kseq if k_order else lanes, g)
            assert torch.equal(part(got, g), want), f"group {g} (path {path})"
            assert not torch.equal(part(got, g), part(lanes if k_order else kseq, g))


def test_other_kinds_and_missing_bodies_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    groups, scratch = _groups([2]), torch.empty(cpu_fused.expert_gemm_scratch(2, 16))
    out = torch.empty(2, 4)
    bf16 = StoredWeight(torch.ones(1, 4, 16, dtype=torch.bfloat16), "bf16")
    e4m3 = StoredWeight(
        torch.zeros(1, 4, 16, dtype=torch.uint8), "e4m3", torch.ones(1, 4, 1), "fp32", 16
    )
    x16, x32 = torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(2, 16)
    for vector in _bodies():
        with pytest.raises(ValueError, match=f"vector='{vector}' needs bf16 x and bf16 weights"):
            cpu_fused.expert_gemm(x32, None, groups, bf16, out, scratch, vector=vector)
        with pytest.raises(
            ValueError, match=r"needs bf16 x and bf16 weights, got x torch\.bfloat16"
        ):
            cpu_fused.expert_gemm(x16, None, groups, e4m3, out, scratch, vector=vector)
    monkeypatch.setattr(cpu_fused, "vector_bodies", lambda: 0)
    with pytest.raises(ValueError, match="vector='avx2kseq': this build or CPU lacks"):
        cpu_fused.expert_gemm(x16, None, groups, bf16, out, scratch, vector="avx2kseq")


def test_the_packed_layout_is_columns_in_blocks_of_16() -> None:
    """Column 16b + j of expert e at `[e, b, :, j]`, in increasing k; the last block's
    missing columns zero; the source untouched; fp32 values exact in bf16 (strided, as the
    prepared weights' views) pack to the same bits, an inexact one is refused."""
    w = torch.randn(3, 37, 5).bfloat16()
    before = w.clone()
    p = cpu_fused.pack_k16(w)
    assert tuple(p.codes.shape) == (3, 3, 5, 16) and (p.n, p.k) == (37, 5)
    for e in range(3):
        for col in range(48):
            got = p.codes[e, col // 16, :, col % 16]
            want = w[e, col] if col < 37 else torch.zeros(5, dtype=torch.bfloat16)
            assert torch.equal(got, want), (e, col)
    assert torch.equal(w, before)
    assert p.nbytes(2) == 2 * 3 * 5 * 16 * 2
    wide = w.float().transpose(1, 2).contiguous().transpose(1, 2)  # [E, N, K], K strided
    assert torch.equal(cpu_fused.pack_k16(wide).codes, p.codes)
    wide[1, 20, 3] += 2.0**-12 * float(wide[1, 20, 3].abs())  # past bf16's 8 bits
    with pytest.raises(ValueError, match=r"pack_k16: weight \[1, 20, 3\] = .* is not exact"):
        cpu_fused.pack_k16(wide)


def test_packed_weights_are_refused_outside_the_k_order() -> None:
    groups, scratch = _groups([2]), torch.empty(cpu_fused.expert_gemm_scratch(2, 16))
    out = torch.empty(2, 4)
    packed = cpu_fused.pack_k16(torch.ones(1, 4, 16, dtype=torch.bfloat16))
    x16 = torch.ones(2, 16, dtype=torch.bfloat16)
    for vector in (False, "avx2", "amx_scalar", "bf16dot_scalar"):
        with pytest.raises(ValueError, match=r"PackedK16 weights with the k-order bodies only"):
            cpu_fused.expert_gemm(x16, None, groups, packed, out, scratch, vector=vector)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"expert_gemm x must be \[R, 16\] bf16 / fp32, got torch.uint8"
    ):
        cpu_fused.expert_gemm(x16.view(torch.uint8), None, groups, packed, out, scratch)
    with pytest.raises(
        ValueError, match=r"pack_k16 packs bf16 / fp32 \[E, N, K\] weights, got torch.uint8"
    ):
        cpu_fused.pack_k16(torch.zeros(1, 4, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"contiguous bf16 / uint8 \[E, 1, K, 16\] for n=4"):
        PackedK16(torch.zeros(1, 1, 16, 8, dtype=torch.bfloat16), 4)
    codes = torch.zeros(1, 1, 32, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"takes scales with uint8 e4m3 codes and with them only"):
        PackedK16(codes, 4)
    with pytest.raises(
        ValueError, match=r"scales must be contiguous fp32 \[1, 1, 1, 16\] \(block 32"
    ):
        PackedK16(codes, 4, torch.ones(1, 1, 2, 16), 32)


def reference_kseq_fp32_x(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The k order for fp32 `x [Q, K]` and bf16 `w [N, K]`: one rounding per step of
    `acc + x_k w_k` (the fma), emulated in float64, where the product is exact (24 + 8
    significant bits) and, with these data's magnitudes, so is the sum before it is rounded
    to fp32."""
    xd, wd = x.double(), w.double()
    acc = torch.zeros(int(x.shape[0]), int(w.shape[0]))
    for e in range(int(x.shape[1])):
        acc = (acc.double() + xd[:, e : e + 1] * wd[:, e]).float()
    return acc


def test_packed_weights_take_fp32_x_in_the_k_order() -> None:
    """fp32 activations (the quantized formats' compute dtype) on packed weights: every
    body gives the k order's fma chain, bit for bit; a mul then an add (two roundings) would
    differ on these data."""
    counts = [0, 1, 5, 8, 13, 40]
    g = torch.Generator().manual_seed(9)
    n, k = 21, 77
    w = torch.randn(len(counts), n, k, generator=g).bfloat16()
    x = torch.randn(sum(counts), k, generator=g)
    rows = torch.arange(sum(counts))
    groups = _groups(counts)
    want = torch.cat(
        [reference_kseq_fp32_x(x[groups.q_start[e] : groups.q_start[e + 1]], w[e]) for e in
         range(len(counts))]
    )  # fmt: skip
    two = torch.cat(
        [reference_kseq(x[groups.q_start[e] : groups.q_start[e + 1]], w[e]) for e in
         range(len(counts))]
    )  # fmt: skip
    assert not torch.equal(two, want)
    for vector in _bodies(packed=True):
        got = _run(x, rows, w, groups, vector, torch.float32, None, packed=True)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), vector


def test_the_python_threshold_is_the_libraries() -> None:
    src = cpu_fused.SOURCE.read_text()
    m = re.search(r"#define EG_KSEQ_ROWS (\d+)", src)
    assert m is not None and int(m.group(1)) == cpu_fused.KSEQ_ROWS


def _e4m3_weights(
    experts: int, n: int, k: int, block: int, seed: int, scale: str = "fp32"
) -> tuple[StoredWeight, torch.Tensor]:
    """NaN-free e4m3 codes of every other kind (subnormal, zero, both signs, 448) and their
    per-row block scales, and their dequantized values (the recipes' product: code * scale
    in fp32)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (experts, n, k), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # the NaN codes -> 448
    if scale == "fp32":
        scales = torch.rand(experts, n, k // block, generator=g) * 0.02 + 1e-3
        full = scales
    else:  # e8m0 bytes 2^-20 .. 2^-1
        scales = torch.randint(107, 127, (experts, n, k // block), generator=g).to(torch.uint8)
        full = torch.pow(2.0, scales.float() - 127)
    deq = codes.view(torch.float8_e4m3fn).float() * full.repeat_interleave(block, dim=2)
    return StoredWeight(codes, "e4m3", scales, scale, block), deq  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "k", "block", "scale"),
    [(37, 256, 128, "fp32"), (16, 128, 32, "e8m0"), (5, 64, 16, "fp32"), (50, 384, 128, "fp32")],
)
def test_packed_codes_take_the_k_order_on_their_dequantized_values(
    n: int, k: int, block: int, scale: str
) -> None:
    """e4m3 codes packed with their scales (fp8's fp32 block scales, mxfp8's e8m0 ones),
    decoded in registers: every body gives the k order's fma chain on the recipes'
    dequantized values (code * scale, one fp32 product), bit for bit, on ragged groups
    (empty, 1-300 rows: every row tile and the K-blocked multi-tile items), fp32 and bf16
    out, 1 and 2 threads; a partial last block of 16 columns at N = 37, 5 and 50."""
    w, deq = _e4m3_weights(len(RAGGED), n, k, block, seed=n, scale=scale)
    packed = cpu_fused.pack_k16_codes(w)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(sum(RAGGED), k, generator=g).bfloat16().float()  # products exact in fp64
    groups = _groups(RAGGED)
    want = torch.cat(
        [reference_kseq_fp32_x(x[groups.q_start[e] : groups.q_start[e + 1]], deq[e]) for e in
         range(len(RAGGED))]
    )  # fmt: skip
    assert int((want != 0).sum()) > want.numel() // 2
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for vector in _bodies(packed=True):
                for dtype in (torch.float32, torch.bfloat16):
                    out = torch.full((groups.rows, n), float("nan"), dtype=dtype)
                    scratch = torch.empty(cpu_fused.expert_gemm_scratch(groups.rows, k))
                    rows = torch.arange(groups.rows)
                    assert cpu_fused.expert_gemm(
                        x, rows, groups, packed, out, scratch, vector=vector
                    )
                    differ = int((out != want.to(dtype)).sum())
                    assert differ == 0, f"{vector}, {threads} threads, {dtype}: {differ} differ"
    finally:
        torch.set_num_threads(before)


def test_the_codes_comparison_sees_planted_faults() -> None:
    """The data tell the packed codes' exact products from the faults a decode could make: a
    scale block shifted by one, the scale applied after the sum of a block (other roundings),
    and the subnormal codes decoded as zeros."""
    counts = [3, 8]
    w, deq = _e4m3_weights(len(counts), 16, 256, 128, seed=2)
    x = torch.randn(sum(counts), 256, generator=torch.Generator().manual_seed(4))
    x = x.bfloat16().float()
    groups = _groups(counts)

    def run(weights: torch.Tensor) -> torch.Tensor:
        return torch.cat(
            [reference_kseq_fp32_x(x[groups.q_start[e] : groups.q_start[e + 1]], weights[e])
             for e in range(len(counts))]
        )  # fmt: skip

    out = torch.empty(groups.rows, 16)
    scratch = torch.empty(cpu_fused.expert_gemm_scratch(groups.rows, 256))
    cpu_fused.expert_gemm(x, None, groups, cpu_fused.pack_k16_codes(w), out, scratch)
    assert torch.equal(out, run(deq))
    assert w.scales is not None
    codes = w.codes.view(torch.float8_e4m3fn).float()
    shifted = codes * w.scales.roll(1, dims=2).repeat_interleave(128, dim=2)
    subnormal = (w.codes & 0x78) == 0
    assert int(subnormal.sum()) > 0
    for fault in (shifted, deq.masked_fill(subnormal, 0.0)):
        assert not torch.equal(out, run(fault))
    per_block = torch.zeros_like(out)  # sum of code * x per block, then times the scale
    for e in range(len(counts)):
        xs = x[groups.q_start[e] : groups.q_start[e + 1]]
        for kb in range(2):
            part = reference_kseq_fp32_x(
                xs[:, kb * 128 : (kb + 1) * 128], codes[e][:, kb * 128 : (kb + 1) * 128]
            )
            per_block[groups.q_start[e] : groups.q_start[e + 1]] += part * w.scales[e, :, kb]
    assert not torch.equal(out, per_block)


def test_the_packed_codes_layout_and_their_widening() -> None:
    """Codes at `[e, b, :, j]` for column 16b + j and scales at `[e, b, kb, j]` (e8m0 as
    their fp32 values), the last block's missing columns zero; `widen` gives the dequantized
    values of any column range, bit for bit."""
    w, deq = _e4m3_weights(2, 37, 64, 32, seed=6, scale="e8m0")
    p = cpu_fused.pack_k16_codes(w)
    assert p.code == "e4m3" and p.scale == "fp32" and (p.n, p.k, p.block) == (37, 64, 32)
    assert p.scales is not None and w.scales is not None
    for e in range(2):
        for col in range(48):
            got, s = p.codes[e, col // 16, :, col % 16], p.scales[e, col // 16, :, col % 16]
            if col < 37:
                assert torch.equal(got, w.codes[e, col])
                assert torch.equal(s, torch.pow(2.0, w.scales[e, col].float() - 127))
            else:
                assert not bool(got.any()) and not bool(s.any())
    assert p.nbytes(2) == 2 * (3 * 64 * 16 + 3 * 2 * 16 * 4)
    for e, j, m in ((0, 0, 37), (1, 16, 21), (1, 32, 5), (0, 0, 16)):
        dst = torch.full((48, 64), float("nan"))
        p.widen(e, j, m, dst)
        assert torch.equal(dst[:m], deq[e, j : j + m]), (e, j, m)


def test_codes_that_do_not_pack_are_refused_with_the_reason() -> None:
    w, _ = _e4m3_weights(1, 16, 128, 128, seed=1)
    assert w.scales is not None
    nan = StoredWeight(w.codes.clone(), "e4m3", w.scales, "fp32", 128)
    nan.codes[0, 3, 5] = 0xFF
    big = StoredWeight(w.codes, "e4m3", w.scales * 0 + 256.0, "fp32", 128)
    inf = StoredWeight(w.codes, "e4m3", w.scales.clone().fill_(float("inf")), "fp32", 128)
    e2m1 = StoredWeight(w.codes[..., :64], "e2m1", w.scales, "fp32", 128)
    for bad, why in (
        (nan, "hold e4m3 NaN codes"),
        (big, "scale is not finite or not below 256"),
        (inf, "scale is not finite or not below 256"),
        (e2m1, "e2m1 codes with fp32 scales"),
    ):
        assert cpu_fused.codes_unpackable(bad) is not None
        with pytest.raises(ValueError, match=f"pack_k16_codes: .*{why}"):
            cpu_fused.pack_k16_codes(bad)
    assert cpu_fused.codes_unpackable(w) is None

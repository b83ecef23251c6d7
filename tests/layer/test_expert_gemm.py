"""The CPU expert GEMM of few rows (`cpu_fused.expert_gemm`) and its crossover in `run_experts`.

References we did not derive from the kernel: torch's own e4m3fn -> fp32 conversion and the
OCP e2m1 / E8M0 value definitions for the in-register decode; a float64 emulation of the sum
order cpu_fused.c documents (16 lanes, one fma each, the fixed pairwise lane reduction) for
the arithmetic; the existing `mm` path of `run_experts` for the wiring (on data whose sums
are exact in fp32, so any order gives the same bits and a bit-for-bit comparison is fair).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from stored_cases import E2M1, random_stored

from moe_ep import quant
from moe_ep.backends.portable import cpu_fused, experts
from moe_ep.backends.portable.comm import Workspace
from moe_ep.backends.portable.cpu_fused import ExpertGroups, StoredWeight
from moe_ep.backends.portable.recipes import (
    Bf16Recipe,
    Fp8BlockRecipe,
    Fp8Fp4Recipe,
    Fp8Nvfp4Recipe,
    Mxfp8Mxfp4Recipe,
    Mxfp8Recipe,
    Nvfp4Recipe,
    PreparedWeights,
    Recipe,
)
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import MoEWeightPack

pytestmark = pytest.mark.skipif(cpu_fused.library() is None, reason="no fused CPU library")

RAGGED = [0, 1, 2, 3, 5, 17, 48, 49, 50, 97, 0, 300, 1]  # rows per expert, empty ones too
BODIES: list[bool | cpu_fused.Body] = ["avx512", "avx2", False]
BODY_IDS = ["avx512", "avx2", "scalar"]
_BODY_BIT = {"avx2": 1, "avx512": 4}


def need_body(vector: bool | cpu_fused.Body) -> None:
    """Skip, with the reason, where this build or CPU lacks the vector body `vector`."""
    if isinstance(vector, str) and not cpu_fused.vector_bodies() & _BODY_BIT[vector]:
        pytest.skip(f"this build or CPU has no {vector} expert GEMM body")


def _fma32(a: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add (one rounding), via float64: an fp32 x fp32 product is exact
    in float64, so only the sum is rounded twice (a 1-ulp tie case that these seeds miss)."""
    return (a.double() + x.double() * w.double()).float()


def reference_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    q_start: list[int],
    expert: list[int],
    alpha: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 `[Q, N]`: the order cpu_fused.c documents, from fp32 `x [Q, K]`, `w [E, N, K]`."""
    q, k = x.shape
    k16 = -(-k // 16) * 16
    xp = torch.zeros(q, k16)
    xp[:, :k] = x
    out = torch.empty(q, int(w.shape[1]))
    for g, e in enumerate(expert):
        lo, hi = q_start[g], q_start[g + 1]
        if lo == hi:
            continue
        wp = torch.zeros(int(w.shape[1]), k16)
        wp[:, :k] = w[e]
        xs = xp[lo:hi].view(hi - lo, 1, k16 // 16, 16)
        ws = wp.view(1, -1, k16 // 16, 16)
        acc = torch.zeros(hi - lo, int(w.shape[1]), 16)  # indexed by element of the chunk
        for c in range(k16 // 16):
            acc = _fma32(acc, xs[:, :, c], ws[:, :, c])
        t = acc[..., 0::2] + acc[..., 1::2]  # lanes j and j + 8 hold elements 2j and 2j + 1
        u = t[..., :4] + t[..., 4:]
        v = u[..., :2] + u[..., 2:]
        s = v[..., 0] + v[..., 1]
        out[lo:hi] = s if alpha is None else s * alpha[g]
    return out


def _groups(counts: list[int], experts_of: list[int] | None = None) -> ExpertGroups:
    q_start = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    expert = torch.tensor(experts_of or list(range(len(counts))), dtype=torch.int64)
    return ExpertGroups(q_start, expert, q_start[:-1].clone())


def _run(
    x: torch.Tensor,
    w: StoredWeight,
    groups: ExpertGroups,
    out_dtype: torch.dtype,
    alpha: torch.Tensor | None = None,
    vector: bool | cpu_fused.Body = True,
    x_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    q = groups.rows
    out = torch.full((q, w.n), float("nan"), dtype=out_dtype)
    scratch = torch.empty(cpu_fused.expert_gemm_scratch(q, w.k))
    assert cpu_fused.expert_gemm(x, x_rows, groups, w, out, scratch, alpha=alpha, vector=vector)
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    ia = a.view(torch.int16 if a.element_size() == 2 else torch.int32)
    ib = b.view(torch.int16 if b.element_size() == 2 else torch.int32)
    bad = (ia != ib).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} elements differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize(("n", "k"), [(37, 40), (64, 19), (9, 300), (33, 529)])
@pytest.mark.parametrize("vector", BODIES, ids=BODY_IDS)
def test_bf16_matches_the_documented_order(n: int, k: int, vector: bool | cpu_fused.Body) -> None:
    need_body(vector)
    g = torch.Generator().manual_seed(n * 1000 + k)
    counts = RAGGED
    e = len(counts)
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    w = torch.randn(e, n, k, generator=g).bfloat16()
    want = reference_gemm(
        x.float(), w.float(), [0, *torch.tensor(counts).cumsum(0)], list(range(e)), None
    )
    groups = _groups(counts)
    _bits_equal(_run(x, StoredWeight(w, "bf16"), groups, torch.float32, vector=vector), want)
    _bits_equal(
        _run(x, StoredWeight(w, "bf16"), groups, torch.bfloat16, vector=vector), want.bfloat16()
    )


def test_vector_body_equals_scalar_twin_on_gathered_rows_with_alpha() -> None:
    if not cpu_fused.vector_bodies() & 1:
        pytest.skip("this build has no AVX2 expert GEMM body")
    g = torch.Generator().manual_seed(7)
    counts, n, k = [3, 0, 61, 1, 250], 45, 2 * 256 + 48
    x = torch.randn(400, k, generator=g).bfloat16()
    x_rows = torch.randint(0, 400, (sum(counts),), generator=g)
    w = StoredWeight(torch.randn(6, n, k, generator=g).bfloat16(), "bf16")
    groups = _groups(counts, [5, 0, 2, 2, 3])  # an expert twice, expert 1 and 4 unused
    alpha = torch.rand(len(counts), generator=g) + 0.5
    got = _run(x, w, groups, torch.bfloat16, alpha, True, x_rows)
    _bits_equal(got, _run(x, w, groups, torch.bfloat16, alpha, False, x_rows))
    want = reference_gemm(
        x[x_rows].float(), w.codes.float(), [0, 3, 3, 64, 65, 315], [5, 0, 2, 2, 3], alpha
    )
    _bits_equal(got, want.bfloat16())


BLOCK_EDGES = [1, 2, 3, 4, 5, 8, 23, 24, 25, 26, 47, 48, 49, 0, 73, 96, 97, 121]
"""Rows per expert around the kernel's row tiles (3 AVX2, 4 AVX-512), row blocks (24) and
work items (96): whole-row streaming (1 to 3 or 4 rows), every partial register tile, and
blocks and items that end one row early or late."""


def _padded_codes(codes: torch.Tensor, poison: int) -> torch.Tensor:
    """`codes [E, N, K']` as a view into rows 40 elements wider whose padding is `poison`
    (bf16 NaN bits or a NaN e4m3 byte): a kernel reading past K would turn outputs NaN."""
    e, n, k = codes.shape
    bits = torch.int16 if codes.element_size() == 2 else torch.uint8
    wide = torch.full((e, n, k + 40), poison, dtype=bits)
    wide = wide.view(codes.dtype) if codes.dtype == torch.bfloat16 else wide
    wide[:, :, :k] = codes
    return wide[:, :, :k]


@pytest.mark.parametrize("vector", BODIES, ids=BODY_IDS)
@pytest.mark.parametrize(("code", "n", "k"), [("bf16", 37, 19), ("bf16", 66, 529),
                                              ("bf16", 3, 16), ("e4m3", 35, 272)])  # fmt: skip
def test_row_tiles_and_blocks_read_nothing_past_k(
    code: str, n: int, k: int, vector: bool | cpu_fused.Body
) -> None:
    need_body(vector)
    g = torch.Generator().manual_seed(n + k)
    counts = BLOCK_EDGES
    e = len(counts)
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    wf = torch.randn(e, n, k, generator=g)
    if code == "bf16":
        w = StoredWeight(_padded_codes(wf.bfloat16(), 0x7FC0), "bf16")
        deq = wf.bfloat16().float()
    else:
        bytes_ = wf.to(torch.float8_e4m3fn).view(torch.uint8)
        scales = torch.rand(e, n, k // 16, generator=g) + 0.5
        w = StoredWeight(_padded_codes(bytes_, 0x7F), "e4m3", scales, "fp32", 16)
        deq = bytes_.view(torch.float8_e4m3fn).float() * scales.repeat_interleave(16, -1)
    assert w.codes.stride(1) == k + 40
    want = reference_gemm(
        x.float(), deq, [0, *torch.tensor(counts).cumsum(0)], list(range(e)), None
    )
    _bits_equal(_run(x, w, _groups(counts), torch.float32, vector=vector), want)


@pytest.mark.parametrize("vector", BODIES, ids=BODY_IDS)
@pytest.mark.parametrize(
    ("code", "scale", "k"),
    [("e4m3", None, 40), ("e4m3", "fp32", 96), ("e4m3", "e8m0", 96), ("e2m1", "e4m3", 96),
     ("e2m1", "e8m0", 64), ("e2m1", None, 36)],
)  # fmt: skip
def test_quantized_formats_at_every_row_tile_match_the_documented_order(
    code: str, scale: str | None, k: int, vector: bool | cpu_fused.Body
) -> None:
    """Each code and scale kind at row counts around every register tile (the AVX-512 body
    decodes quantized weights in registers: 4 x 4 tiles up to 4 rows, 8 x 2 from 5), with
    37 output columns (a 4-column tile's remainder), a K tail where the kind allows one, a
    NaN code in one weight row, and alphas: bit for bit the reference order's outputs."""
    need_body(vector)
    g = torch.Generator().manual_seed(k + len(code))
    counts, n = BLOCK_EDGES, 37
    e = len(counts)
    w, deq = random_stored(code, scale, e, n, k, g)
    if code == "e4m3":
        w.codes[2, 5, 17] = 0x7F  # expert 2 (3 rows), weight row 5: NaN
        deq[2, 5, 17] = float("nan")
    x = torch.randn(sum(counts), k, generator=g)
    alpha = torch.rand(e, generator=g) + 0.5
    got = _run(x, w, _groups(counts), torch.float32, alpha, vector)
    q_start = [0, *torch.tensor(counts).cumsum(0).tolist()]
    want = reference_gemm(x, deq, q_start, list(range(e)), alpha)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and int(nan.sum()) == (3 if code == "e4m3" else 0)
    _bits_equal(got.masked_fill(nan, 0), want.masked_fill(nan, 0))


def test_thread_counts_give_the_same_bits() -> None:
    g = torch.Generator().manual_seed(3)
    counts, n, k = RAGGED, 200, 384
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    w = StoredWeight(torch.randn(len(counts), n, k, generator=g).bfloat16(), "bf16")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(x, w, _groups(counts), torch.bfloat16)
        torch.set_num_threads(2)
        two = _run(x, w, _groups(counts), torch.bfloat16)
    finally:
        torch.set_num_threads(before)
    _bits_equal(one, two)


# --- in-register decode of the stored formats ----------------------------------------------


def _decoded_by_one_hot_rows(w: StoredWeight) -> torch.Tensor:
    """`[N, K]` fp32: the kernel's dequantized weight row j, read back as identity @ w^T."""
    eye = torch.eye(w.k)
    return _run(eye, w, _groups([w.k]), torch.float32).t()


@pytest.mark.parametrize("vector", BODIES, ids=BODY_IDS)
def test_e4m3_codes_decode_as_torch_does(vector: bool | cpu_fused.Body) -> None:
    need_body(vector)
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # 0x7f / 0xff are NaN: 0 * NaN poisons the rows
    row = torch.cat([finite, finite[:2]]).view(1, 1, -1)  # 256 elements
    w = StoredWeight(row.contiguous(), "e4m3")
    got = _run(torch.eye(w.k), w, _groups([w.k]), torch.float32, vector=vector).t()[0]
    want = row.view(torch.float8_e4m3fn).float().view(-1)
    assert torch.equal(got, want)  # -0 comes out +0 (fma onto +0); equal() treats them alike
    nan_row = torch.full((1, 1, 16), 0x7F, dtype=torch.uint8)
    nan_row[0, 0, 3] = 0xFF
    out = _run(
        torch.ones(1, 16), StoredWeight(nan_row, "e4m3"), _groups([1]), torch.float32, vector=vector
    )
    assert out.isnan().all()


@pytest.mark.parametrize("vector", BODIES, ids=BODY_IDS)
@pytest.mark.parametrize("scale_kind", ["fp32", "e8m0"])
def test_scaled_e4m3_codes_decode_as_code_times_scale(
    vector: bool | cpu_fused.Body, scale_kind: str
) -> None:
    """Every finite code under scales that are subnormal, ordinary, just below 2^8 and from
    2^8 up (the AVX2 body's short decode folds 2^120 * scale into one product below 2^8 and
    takes the general decode from there): each output is torch's e4m3fn value times the
    scale, one fp32 product; a row with one NaN code (the general decode) is NaN."""
    need_body(vector)
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    row = torch.cat([finite, finite[:2]])  # 256 elements: 8 blocks of 32
    rows = torch.stack([row, row.roll(37), row.flip(0)])
    rows[2, 70] = 0x7F  # a NaN code in block 2 of row 2
    if scale_kind == "fp32":
        values = [2.0**-140, 2.0**-126, 0.37, 1.0, 255.9, 256.0, 3.0e5, 2.0**100]
        scales = torch.tensor(values, dtype=torch.float32).repeat(3, 1)
        factor = scales
    else:
        scales = torch.tensor([0, 1, 100, 127, 134, 135, 136, 200], dtype=torch.uint8).repeat(3, 1)
        factor = quant.e8m0_to_float32(scales)
    w = StoredWeight(
        rows.view(1, 3, 256).contiguous(), "e4m3", scales.view(1, 3, 8), scale_kind, 32
    )
    got = _run(torch.eye(w.k), w, _groups([w.k]), torch.float32, vector=vector).t()
    want = rows.view(torch.float8_e4m3fn).float() * factor.repeat_interleave(32, 1)
    assert torch.equal(got[:2], want[:2])  # -0 comes out +0, as above
    assert got[2].isnan().all()  # 0 * NaN: every output of eye @ w^T meets the NaN weight


@pytest.mark.parametrize("vector", BODIES, ids=BODY_IDS)
def test_e2m1_codes_and_scales_decode_as_their_definitions(vector: bool | cpu_fused.Body) -> None:
    need_body(vector)
    k = 64
    nib = torch.arange(k) % 16  # every code, at even and odd positions
    nib = torch.stack([nib, nib.roll(5)])  # [2, k]
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8).view(1, 2, k // 2)
    value = torch.tensor(E2M1 + [-v for v in E2M1])[nib]
    e8m0 = torch.tensor([[[1, 127, 130, 250], [100, 128, 2, 126]]], dtype=torch.uint8)
    w = StoredWeight(packed.contiguous(), "e2m1", e8m0, "e8m0", 16)
    got = _run(torch.eye(k), w, _groups([k]), torch.float32, vector=vector).t()
    want = value * torch.pow(2.0, e8m0.double() - 127).float().view(2, 4).repeat_interleave(16, 1)
    assert torch.equal(got, want)
    e4m3 = torch.tensor([[[0x38, 0x01, 0x77, 0xB4], [0x7E, 0x08, 0x40, 0x30]]], dtype=torch.uint8)
    w = StoredWeight(packed.contiguous(), "e2m1", e4m3, "e4m3", 16)
    got = _run(torch.eye(k), w, _groups([k]), torch.float32, vector=vector).t()
    scale = e4m3.view(torch.float8_e4m3fn).float().view(2, 4).repeat_interleave(16, 1)
    assert torch.equal(got, value * scale)  # scales below 4 and from 4 up (240, 448)
    e4m3[0, 1, 2] = 0x7F  # a NaN scale: weight row 1 is NaN, so every output against it
    w = StoredWeight(packed.contiguous(), "e2m1", e4m3, "e4m3", 16)
    got = _run(torch.eye(k), w, _groups([k]), torch.float32, vector=vector).t()
    assert torch.equal(got[0], (value * scale)[0]) and got[1].isnan().all()


def _pack(e: int, i: int, h: int, seed: int) -> MoEWeightPack:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.05
    w2 = torch.randn(e, h, i, generator=g) * 0.05
    w13[0, :3, :5] = 1e-7  # tiny values: subnormal e4m3 codes / small scales
    return MoEWeightPack(w13=w13.bfloat16(), w2=w2.bfloat16())


QUANTIZED: dict[str, Recipe] = {
    "fp8": Fp8BlockRecipe(),
    "fp8_interleave8": Fp8BlockRecipe(fc1_gate_up_interleave=8),
    "mxfp8": Mxfp8Recipe(),
    "nvfp4": Nvfp4Recipe(act_global_scale=3.0, hidden_global_scale=0.5),
    "fp8_fp4": Fp8Fp4Recipe(),
    "fp8_nvfp4": Fp8Nvfp4Recipe(),  # e4m3 operand codes, no scales, alpha 8 * G
    "mxfp8_mxfp4": Mxfp8Mxfp4Recipe(),
}


@pytest.mark.parametrize("vector", BODIES, ids=BODY_IDS)
@pytest.mark.parametrize("fmt", list(QUANTIZED))
def test_quantized_in_register_decode_equals_the_recipes_dequantized_weights(
    fmt: str, vector: bool | cpu_fused.Body
) -> None:
    need_body(vector)
    recipe = QUANTIZED[fmt]
    e, i, h = 3, 128, 256 + 128
    pw = recipe.prepare(_pack(e, i, h, seed=11))
    assert pw.stored13 is not None and pw.stored2 is not None
    g = torch.Generator().manual_seed(5)
    counts = [5, 0, 130]
    q_start = [0, 5, 5, 135]
    for stored, deq, alpha in (
        (pw.stored13, pw.w13t.transpose(1, 2), pw.alpha13),
        (pw.stored2, pw.w2t.transpose(1, 2), pw.alpha2),
    ):
        x = torch.randn(sum(counts), stored.k, generator=g)
        got = _run(x, stored, _groups(counts), torch.float32, alpha, vector)
        _bits_equal(got, reference_gemm(x, deq.float(), q_start, [0, 1, 2], alpha))


# --- run_experts: the new path against the existing one -------------------------------------

GRID = [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0]  # exact in bf16, e4m3 and e2m1


def _exact_pack(e: int, i: int, h: int, seed: int) -> MoEWeightPack:
    """Weights whose dequantized values have few bits, and a one-hot FC2: every sum of the
    layer is exact in fp32, so both paths must agree bit for bit whatever their order."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(GRID)
    w13 = grid[torch.randint(0, len(GRID), (e, 2 * i, h), generator=g)]
    w2 = torch.zeros(e, h, i)
    for x in range(e):  # output column c of expert x reads one h element (a permutation)
        cols = torch.randperm(h, generator=g) % i
        w2[x, torch.arange(h), cols] = grid[torch.randint(5, 9, (h,), generator=g)]
    return MoEWeightPack(w13=w13.bfloat16(), w2=w2.bfloat16())


CASES: dict[str, tuple[Recipe, int, int]] = {  # recipe, H, I
    "bf16_odd": (Bf16Recipe(), 37, 19),
    "bf16": (Bf16Recipe(), 64, 48),
    "bf16_fc1_fp32": (Bf16Recipe(fc1_output_high_precision=True), 64, 48),
    "mxfp8": (Mxfp8Recipe(), 64, 32),
    "nvfp4": (Nvfp4Recipe(act_global_scale=2.0, hidden_global_scale=4.0), 64, 32),
    "fp8_fp4": (Fp8Fp4Recipe(), 64, 32),
    "fp8_nvfp4": (Fp8Nvfp4Recipe(), 128, 64),
    "mxfp8_mxfp4": (Mxfp8Mxfp4Recipe(), 64, 32),
}


def _inputs(
    pw: PreparedWeights, counts: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows of grid values in the compute dtype, each pair's row, each pair's scale)."""
    g = torch.Generator().manual_seed(seed)
    hidden = int(pw.w2t.shape[2])
    pairs = sum(counts)
    rows = torch.tensor(GRID)[torch.randint(0, len(GRID), (pairs + 7, hidden), generator=g)]
    rows = rows.to(pw.w2t.dtype)
    src_row = torch.randint(0, pairs + 7, (pairs,), generator=g)
    scale = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (pairs,), generator=g)]
    return rows, src_row, scale


def _run_experts(
    recipe: Recipe, pw: PreparedWeights, counts: list[int], limit: int, scaled: bool, seed: int
) -> torch.Tensor:
    rows, src_row, scale = _inputs(pw, counts, seed)
    pairs, hidden = sum(counts), int(pw.w2t.shape[2])
    y = torch.full((pairs, hidden), float("nan"), dtype=torch.bfloat16)
    requantize = None if recipe.requantize_is_rounding else recipe.requantize_into
    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        m.setattr(experts, "expert_gemm_rows", lambda weights, device: limit)
        m.setattr(experts, "amx_for_quantized", lambda weights, device: False)  # mm above
        experts.run_experts(
            rows, src_row, counts, pw, requantize, None, y, Workspace(),
            pair_scale=scale if scaled else None,
        )  # fmt: skip
    return y


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "topk_before_fc2"])
@pytest.mark.parametrize("case", list(CASES))
def test_run_experts_new_path_equals_the_mm_path(case: str, scaled: bool) -> None:
    recipe, h, i = CASES[case]
    pw = recipe.prepare(_exact_pack(len(RAGGED), i, h, seed=2))
    old = _run_experts(recipe, pw, RAGGED, 0, scaled, seed=4)
    assert not old.isnan().any()
    new = _run_experts(recipe, pw, RAGGED, 10**9, scaled, seed=4)
    _bits_equal(new, old)
    mixed = _run_experts(recipe, pw, RAGGED, 49, scaled, seed=4)  # both paths in one call
    _bits_equal(mixed, old)


def test_bf16_fc1_kept_in_fp32_is_fc1_unrounded_through_swiglu() -> None:
    """`Bf16Recipe(fc1_output_high_precision=True)` on both paths: FC1 in fp32 (exact here)
    into SwiGLU, then bf16; the default rounds FC1's output to bf16 first."""
    h, i = 512, 48  # FC1 sums of 512 grid products need more than bf16's 8 bits
    pack = _exact_pack(len(RAGGED), i, h, seed=6)
    kept = Bf16Recipe(fc1_output_high_precision=True).prepare(pack)
    assert kept.w13t.dtype == torch.float32 and kept.w2t.dtype == torch.bfloat16
    assert kept.stored13 is not None and kept.stored13.code == "bf16"
    rows, src_row, _ = _inputs(kept, RAGGED, seed=4)
    want = {}
    for rounded in (False, True):
        parts = []
        starts = itertools.accumulate(RAGGED, initial=0)  # one more than RAGGED
        for e, (s, c) in enumerate(zip(starts, RAGGED, strict=False)):
            x = rows[src_row[s : s + c]].float()
            gu = x @ pack.w13[e].float().t()
            gu = gu.bfloat16().float() if rounded else gu
            act = (F.silu(gu[:, :i]) * gu[:, i:]).bfloat16()
            parts.append((act.float() @ pack.w2[e].float().t()).bfloat16())
        want[rounded] = torch.cat(parts)
    assert not torch.equal(want[False], want[True])  # the FC1 rounding shows
    for limit in (0, 10**9):  # the mm blocks; the CPU expert GEMM
        _bits_equal(_run_experts(Bf16Recipe(), kept, RAGGED, limit, False, seed=4), want[False])
        plain = Bf16Recipe().prepare(pack)
        _bits_equal(_run_experts(Bf16Recipe(), plain, RAGGED, limit, False, seed=4), want[True])
    with pytest.raises(MoeEpUsageError, match="fc1_output_high_precision must be a bool"):
        Bf16Recipe(fc1_output_high_precision=1)  # type: ignore[arg-type]


# --- the crossover ---------------------------------------------------------------------------


def test_crossover_by_format_and_device() -> None:
    bf16 = Bf16Recipe().prepare(_pack(2, 32, 64, seed=1))
    fp8 = Mxfp8Recipe().prepare(_pack(2, 32, 64, seed=1))
    cpu = torch.device("cpu")
    bodies = cpu_fused.vector_bodies()
    amx = bool(bodies & 16)  # cpu_fused.amx_by_default, from the bodies themselves
    want_bf16 = (
        experts.EXPERT_GEMM_ROWS_BF16_AMX
        if amx
        else experts.EXPERT_GEMM_ROWS_BF16_ONEDNN
        if torch.ops.mkldnn._is_mkldnn_bf16_supported()
        else experts.EXPERT_GEMM_ROWS_BF16_KSEQ
        if bodies & 1 and not bodies & 4
        else experts.EXPERT_GEMM_ROWS_BF16
    )
    assert experts.expert_gemm_rows(bf16, cpu) == want_bf16
    want_fp32 = experts.EXPERT_GEMM_ROWS_FP32_AMX_CPU if amx else experts.EXPERT_GEMM_ROWS_FP32
    assert experts.expert_gemm_rows(fp8, cpu) == want_fp32
    assert experts.expert_gemm_rows(bf16, torch.device("cuda")) == 0
    no_stored = PreparedWeights(bf16.w13t, bf16.w2t)
    assert experts.expert_gemm_rows(no_stored, cpu) == 0


def test_run_experts_sends_experts_up_to_the_crossover_to_the_expert_gemm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pw = Bf16Recipe().prepare(_pack(len(RAGGED), 16, 32, seed=1))
    seen: dict[str, list[tuple[int, int, int]]] = {"gemm": [], "mm": []}
    monkeypatch.setattr(experts, "expert_gemm_rows", lambda weights, device: 49)
    monkeypatch.setattr(
        experts, "_run_expert_gemm", lambda rows, src, runs, *a: seen["gemm"].extend(runs)
    )
    monkeypatch.setattr(experts, "_run_blocks", lambda tasks, **kw: seen["mm"].extend(tasks))
    monkeypatch.setattr(cpu_fused, "parallel_workers", lambda device: 1)
    pairs = sum(RAGGED)
    rows = torch.zeros(pairs, 32, dtype=torch.bfloat16)
    y = torch.empty(pairs, 32, dtype=torch.bfloat16)
    experts.run_experts(rows, torch.arange(pairs), RAGGED, pw, None, None, y, Workspace())
    starts = [sum(RAGGED[:e]) for e in range(len(RAGGED))]
    assert seen["gemm"] == [(e, starts[e], c) for e, c in enumerate(RAGGED) if 0 < c <= 49]
    assert seen["mm"] == [(e, starts[e], c) for e, c in enumerate(RAGGED) if c > 49]


def test_segments_split_big_experts_and_cap_each_call() -> None:
    counts = [3, 5000, 0, 7]
    starts = [0, 3, 5003, 5003]
    calls = list(experts._segments([0, 1, 3], starts, counts, 2048))
    assert all(sum(b for *_, b in runs) <= 2048 for runs in calls)
    flat = [run for runs in calls for run in runs]
    assert flat == [(0, 0, 3), (1, 3, 2048), (1, 2051, 2048), (1, 4099, 904), (3, 5003, 7)]


def test_quantize_round_trip_grid_is_exact() -> None:
    """The premise of the bit-for-bit comparison: the grid survives each recipe's weights."""
    pack = _exact_pack(2, 32, 64, seed=9)
    for recipe in (Mxfp8Recipe(), Fp8Fp4Recipe()):
        pw = recipe.prepare(pack)
        assert torch.equal(pw.w13t.transpose(1, 2).float(), pack.w13.float())
    s = quant.e8m0_to_float32(torch.tensor([127], dtype=torch.uint8))
    assert float(s) == 1.0

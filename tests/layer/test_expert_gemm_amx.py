"""The expert GEMM's AMX bodies: AMX-BF16 (`tdpbf16ps`) and its scalar twin.

The reference is a float64 emulation of the order cpu_fused.c documents for them, written
from the instruction's arithmetic as probed on an Intel Xeon with AMX (the current SDM's
pseudo-code has the same shape): K padded to whole 32-chunks; per chunk two fp32 chains from
+0 over its 16 pairs, one of the even elements and one of the odd, each step one fused
multiply-add (exact bf16 products, one RNE rounding), then `acc = acc + (even + odd)`; fp32
subnormal inputs read as zero and subnormal results flushed to zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
from stored_cases import random_stored

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack, quant
from moe_ep.backends.portable import cpu_fused, experts
from moe_ep.backends.portable.comm import Workspace
from moe_ep.backends.portable.cpu_fused import StoredWeight
from moe_ep.backends.portable.recipes import (
    Fp8BlockRecipe,
    Fp8Fp4Recipe,
    Fp8Mxfp4Recipe,
    Fp8Nvfp4Recipe,
    Mxfp8Recipe,
    Nvfp4Recipe,
    Recipe,
)
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.spawn import free_port

pytestmark = pytest.mark.skipif(cpu_fused.library() is None, reason="no fused CPU library")

AMX = 16
"""`cpu_fused.vector_bodies()` bit of the AMX body."""
RAGGED = [0, 1, 2, 3, 4, 15, 16, 17, 24, 0, 33, 64, 65, 97, 200, 300, 1]
"""Rows per expert: empty experts, partial and whole 16-row tiles, the 2 x 2 tiles of a
32-row pass, the bf16 sweeps' groups of 3-4 row blocks (200 rows: 13 blocks, 4 + 3 + 3 + 3),
a 256-row work item and past it."""


def _round(v: torch.Tensor, flush: bool) -> torch.Tensor:
    """float64 -> fp32 (RNE), flushed: one fp32 operation's result."""
    return daz(v.float()) if flush else v.float()


def reference_amx(
    x: torch.Tensor, w: torch.Tensor, *, flush: bool = True, chains: int = 2
) -> torch.Tensor:
    """fp32 `[Q, N]` of bf16 `x [Q, K]` times bf16 `w [N, K]` in the AMX order. `flush`
    False and `chains=1` (one chain over the chunk, in k order) plant the faults the tests
    show this comparison catches."""
    q, k32 = int(x.shape[0]), -(-int(x.shape[1]) // 32) * 32
    xs, ws = chunk_pairs(x, w, flush)
    acc = torch.zeros(q, int(w.shape[0]), dtype=torch.float32)
    for c in range(k32 // 32):
        if chains == 1:  # acc += every product of the chunk in k order
            for p in range(16):
                for e in (0, 1):
                    acc = _round(acc.double() + xs[:, :, c, p, e] * ws[:, :, c, p, e], flush)
            continue
        even = torch.zeros_like(acc)
        odd = torch.zeros_like(acc)
        for p in range(16):
            # bf16 x bf16 is exact in float64, so only the sum rounds (twice, float64 then
            # fp32: a tie case these data miss, as in test_expert_gemm's _fma32)
            even = _round(even.double() + xs[:, :, c, p, 0] * ws[:, :, c, p, 0], flush)
            odd = _round(odd.double() + xs[:, :, c, p, 1] * ws[:, :, c, p, 1], flush)
        acc = _round(acc.double() + _round(even.double() + odd.double(), flush).double(), flush)
    return acc


def _want(x: torch.Tensor, w: torch.Tensor, counts: list[int], **fault: object) -> torch.Tensor:
    out, q0 = [], 0
    for e, rows in enumerate(counts):
        out.append(reference_amx(x[q0 : q0 + rows], w[e], **fault))  # type: ignore[arg-type]
        q0 += rows
    return torch.cat(out)


def _bodies() -> list[cpu_fused.Body]:
    return ["amx_scalar", *(["amx"] if cpu_fused.vector_bodies() & AMX else [])]


@pytest.mark.parametrize(("n", "k"), [(37, 19), (70, 1043), (9, 2048), (33, 64), (16, 32)])
def test_amx_bodies_match_the_emulation_at_one_and_two_threads(n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(len(RAGGED), n, k, generator=g).bfloat16()
    x = torch.randn(sum(RAGGED), k, generator=g).bfloat16()
    want = _want(x, w, RAGGED)
    bodies: list[bool | cpu_fused.Body] = [
        *_bodies(),
        *([True] if cpu_fused.vector_bodies() & AMX else []),
    ]
    at_one_and_two_threads(bodies_match(x, w, RAGGED, want, bodies))  # True: every group on AMX
    # the comparison tells the AMX order from one chain per chunk and from the dot order
    assert differ(_want(x, w, RAGGED, chains=1), want) > 0
    assert differ(run(x, w, RAGGED, "bf16dot_scalar"), want) > 0


def test_subnormal_inputs_and_results_are_flushed_as_the_instruction_does() -> None:
    g = torch.Generator().manual_seed(5)
    counts, n, k = [3, 0, 6, 17], 21, 77
    x = torch.randn(sum(counts), k, generator=g)
    # row 0: subnormal bf16 inputs only (2^-130.4 to 2^-127); times w ~ 2^10, normal products
    x[0] = x[0].sign() * (0.1 + 0.9 * torch.rand(k, generator=g)) * 2.0**-127
    x[1] = torch.where(torch.rand(k, generator=g) < 0.25, x[0], x[1])
    x[3:] *= 2.0**-63  # times w ~ 2^-64: products and sums below fp32's smallest normal
    w = torch.randn(len(counts), n, k, generator=g)
    w[0] *= 2.0**10
    w[2:] *= 2.0**-64
    x, w = x.bfloat16(), w.bfloat16()
    assert ((x[0].float().abs() < TINY) & (x[0] != 0)).all()
    want = _want(x, w, counts)
    unflushed = _want(x, w, counts, flush=False)
    assert (want[0] == 0).all() and (unflushed[0] != 0).all()  # inputs read as zero
    assert differ(unflushed[3:], want[3:]) > 0  # subnormal results flushed
    for vector in _bodies():
        assert differ(run(x, w, counts, vector), want) == 0, vector
        # fp32 x: subnormals read as zero too, even those bf16 cannot hold (not refused)
        x32 = x.float()
        x32[0, :5] = 1e-40
        assert differ(run(x32, w, counts, vector), want) == 0, vector


def test_non_finite_weights_past_k_and_n_are_never_read() -> None:
    """The A tiles of a partial chunk or block come from a zero-padded copy: weights past
    an expert's K or N (here inf / NaN in the tensor's padding) never meet the zero x."""
    g = torch.Generator().manual_seed(8)
    counts, n, k = [5, 16, 2], 19, 45
    full = torch.full((len(counts), n + 5, k + 19), float("inf")).bfloat16()
    full[:, n:, :] = float("nan")
    full[:, :n, :k] = torch.randn(len(counts), n, k, generator=g).bfloat16()
    w = full[:, :n, :k]  # rows k + 19 elements apart, n of n + 5 rows
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    want = _want(x, w.contiguous(), counts)
    for vector in _bodies():
        rows = groups(counts)
        out = torch.empty(rows.rows, n)
        scratch = torch.empty(cpu_fused.expert_gemm_scratch(rows.rows, k))
        stored = StoredWeight(w, "bf16")
        assert cpu_fused.expert_gemm(x, None, rows, stored, out, scratch, vector=vector)
        assert differ(out, want) == 0, vector


def test_the_default_takes_amx_whatever_the_path_rows() -> None:
    """Where the CPU has AMX the default sums every bf16 group in the AMX order, 1-2-row
    groups and any path rows (a replica's logical expert's count) included, so every copy
    of an expert sums alike."""
    if not cpu_fused.vector_bodies() & AMX:
        pytest.skip("vector=True takes the AMX body only where the CPU has AMX")
    g = torch.Generator().manual_seed(9)
    counts, path, n, k = [2, 5, 1], [40, 2, 1], 24, 300
    w = torch.randn(len(counts), n, k, generator=g).bfloat16()
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    want = _want(x, w, counts)
    assert differ(run(x, w, counts, True, path=path), want) == 0
    assert differ(run(x, w, counts, True), want) == 0
    assert differ(run(x, w, counts, "avx2"), want) > 0


def test_amx_bodies_refuse_a_missing_body() -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1, 8, 32, generator=g).bfloat16()
    x = torch.randn(4, 32, generator=g)
    if not cpu_fused.vector_bodies() & AMX:
        with pytest.raises(ValueError, match="lacks that body"):
            run(x.bfloat16(), w, [4], "amx")


def _bf16_exact(v: torch.Tensor) -> torch.Tensor:
    """fp32 values with subnormals read as zero, as bf16: asserted exact."""
    flushed = daz(v.float())
    out = flushed.bfloat16()
    assert torch.equal(out.float(), flushed) or bool(flushed.isnan().any())
    return out


@pytest.mark.parametrize(
    ("code", "scale", "k", "block"),
    [("e4m3", "e8m0", 96, None), ("e4m3", None, 40, None), ("e2m1", "e4m3", 96, None),
     ("e2m1", "e8m0", 64, None), ("e2m1", None, 36, None),
     # scale blocks other than the formats' (one scale over several chunks, or a chunk
     # split between two scales): the decode's scale index must follow K
     ("e4m3", "e8m0", 256, 64), ("e4m3", "e8m0", 256, 128), ("e2m1", "e4m3", 96, 48),
     ("e2m1", "e8m0", 128, 64),
     # e2m1 items of up to 32 rows decode EG_AMX_ICH chunks at a time as they go: K of many
     # such groups, the last one partial
     ("e2m1", "e4m3", 1056, None), ("e2m1", "e8m0", 2080, None)],
)  # fmt: skip
def test_codes_exact_in_bf16_run_in_the_amx_order(
    code: str, scale: str | None, k: int, block: int | None
) -> None:
    """mxfp8's, nvfp4's and mxfp4's weights (every code, scales over a wide range) and fp32
    x exact in bf16 (mxfp8-dequantized activations): bit for bit the AMX order on the
    dequantized values (code * scale in fp32, subnormals read as zero), with alphas, K tails
    where the kind allows, fp32 and bf16 outputs."""
    g = torch.Generator().manual_seed(k + len(code))
    counts, n = [3, 0, 17, 1, 40, 16], 37
    w, deq = random_stored(code, scale, len(counts), n, k, g, block)
    x32 = torch.randn(sum(counts), k, generator=g) * 4
    k32 = -(-k // 32) * 32
    x32 = torch.nn.functional.pad(x32, (0, k32 - k))  # the activations as mxfp8 dequantizes them
    x = quant.dequantize_mxfp8(*quant.quantize_mxfp8(x32))[:, :k].contiguous()
    alpha = torch.rand(len(counts), generator=g) + 0.5
    want, q0 = [], 0
    for e, rows in enumerate(counts):
        ref = reference_amx(_bf16_exact(x[q0 : q0 + rows]), _bf16_exact(deq[e]))
        want.append(ref * alpha[e])
        q0 += rows
    expect = torch.cat(want)
    for vector in _bodies():
        got = run(x, w, counts, vector, alpha=alpha)
        assert differ(got, expect) == 0, vector
        got16 = run(x, w, counts, vector, torch.bfloat16, alpha=alpha)
        assert differ(got16, expect.bfloat16()) == 0, vector
    if scale is not None:  # the fp32 order gives other bits (unscaled e2m1 sums are exact)
        assert differ(run(x, w, counts, False, alpha=alpha), expect) > 0


def _edge_weights(
    code: str, scale: str | None, n: int, k: int, special: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """One expert's codes and scale bytes covering every scale byte. Rows below n - special
    are finite: no NaN code, e8m0 bytes 0-246 (products of every code stay finite), e4m3
    ones all but NaN. Each of the last `special` rows holds at most one non-finite weight,
    so the one-hot x row at its position shows it (inf, not NaN): with e8m0 scales, block 0
    scaled by a byte of 247-254 over small codes and one large one (its product overflows
    to inf), or one NaN code, or (the last row) byte 255 (NaN); with e4m3 scales, NaN ones.
    Returns (stored codes, stored scales, code values, scale values per element)."""
    finite, half = n - special, n - special // 2
    if code == "e4m3":
        codes = torch.randint(0, 256, (n, k), generator=g).to(torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x01  # the smallest subnormal instead
        codes[finite:, :32] &= 0xBF  # |value| < 2: finite times any e8m0 byte below 255
        for i, row in enumerate(range(finite, n)):
            codes[row, (3 * i) % 32] = (0x79 + i % 6) if row < half else (0x7F | (i % 2) << 7)
        stored, value = codes, codes.view(torch.float8_e4m3fn).float()
    else:
        nib = torch.randint(0, 16, (n, k), generator=g)
        sign = 8 * torch.randint(0, 2, (special, 32), generator=g)
        nib[finite:, :32] = torch.randint(0, 3, (special, 32), generator=g) + sign  # |v| <= 1
        for i, row in enumerate(range(finite, n)):
            nib[row, (3 * i) % 32] = 7 + 8 * (i % 2)  # +-6: the one product that can overflow
        stored = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)
        value = torch.tensor(E2M1_SIGNED)[nib]
    if scale is None:
        return stored, None, value, torch.ones(n, k)
    block = 32 if scale == "e8m0" else 16
    nb = k // block
    if scale == "e8m0":
        s = torch.arange(n * nb).reshape(n, nb) % 237 + 10
        s[:finite] = torch.arange(finite * nb).reshape(finite, nb) % 247
        s[finite:, 0] = torch.arange(special) % 8 + 247
        s[n - 1, 0] = 255
        factor = quant.e8m0_to_float32(s.to(torch.uint8))
    else:
        byte = torch.arange(n * nb).reshape(n, nb) % 254
        s = byte + (byte >= 0x7F).long()  # every e4m3 byte but 0x7f / 0xff
        s[finite:, 0] = torch.tensor([0x7F, 0xFF]).repeat(special)[:special]
        factor = s.to(torch.uint8).view(torch.float8_e4m3fn).float()
    return stored, s.to(torch.uint8), value, factor.repeat_interleave(block, -1)


E2M1_SIGNED = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
               -6.0]  # fmt: skip


def _nan_aware_differ(got: torch.Tensor, want: torch.Tensor) -> int:
    """Outputs that differ in their bits, NaN against NaN counted equal (the NaN a sum ends
    in is the instruction's own)."""
    both = got.isnan() & want.isnan()
    return differ(torch.where(both, 0.0, got), torch.where(both, 0.0, want))


@pytest.mark.parametrize(
    ("code", "scale", "k"),
    [("e4m3", "e8m0", 160), ("e4m3", None, 96), ("e2m1", "e4m3", 144), ("e2m1", "e8m0", 160),
     ("e2m1", None, 64)],
)  # fmt: skip
def test_every_scale_byte_decodes_as_the_formats_define(
    code: str, scale: str | None, k: int
) -> None:
    """The AMX bodies' weight decode (16 bits a lane where a chunk allows it, element by
    element where it does not: NaN codes, e8m0 scales whose products leave bf16's normals, a
    K tail) read through one-hot x rows, so an output is one weight as the A tile holds it
    (plus zeros): against code x scale by the formats' definitions in fp32, subnormal
    products read as zero, every scale byte, NaN scales and codes included; ragged groups of
    1, 16 and K rows (one pass, and the item's tiles decoded once for several passes)."""
    g = torch.Generator().manual_seed(k * 7 + len(code))
    n, special = 80, 12
    stored, s, value, factor = _edge_weights(code, scale, n, k, special, g)
    decoded = daz(value * factor)  # fp32 products, subnormals read as zero
    counts = [16] * (k // 16) + [k, 1]
    x = torch.cat([torch.eye(k)[16 * i : 16 * i + 16] for i in range(k // 16)]
                  + [torch.eye(k), torch.eye(k)[-1:]]).bfloat16()  # fmt: skip
    e = len(counts)
    codes = stored.expand(e, *stored.shape).contiguous()
    w = StoredWeight(codes, code)  # type: ignore[arg-type]
    if s is not None:
        w = StoredWeight(codes, code, s.expand(e, *s.shape).contiguous(), scale,  # type: ignore[arg-type]
                         32 if scale == "e8m0" else 16)  # fmt: skip
    want = _want(x, _bf16_exact(decoded).expand(e, n, k), counts)
    assert want[:, : n - special].isfinite().all()  # the finite rows stay finite
    if scale == "e8m0":  # an overflowing product shows as inf at its one-hot row
        assert want[:, n - special :].isinf().any()
    for vector in _bodies():
        assert _nan_aware_differ(run(x, w, counts, vector), want) == 0, vector
    if scale is None:
        return
    got = run(x, w, counts, _bodies()[-1])
    # the comparison catches e8m0 byte 0 read as zero (it is 2^-127), the scales of the
    # wrong half chunk, and e8m0 bytes past 246 added to the exponent as the fast decode would
    if scale == "e8m0":
        zero = _want(x, _bf16_exact(daz(value * torch.where(factor < TINY, 0.0, factor)))
                     .expand(e, n, k), counts)  # fmt: skip
        assert _nan_aware_differ(got, zero) > 0
    if scale == "e4m3":
        whole = k // 32 * 32
        swapped = factor.clone()
        swapped[:, :whole] = factor[:, :whole].reshape(n, -1, 2, 16).flip(2).reshape(n, whole)
        wrong = _want(x, _bf16_exact(daz(value * swapped)).expand(e, n, k), counts)
        assert _nan_aware_differ(got, wrong) > 0
    if scale == "e8m0" and code == "e4m3" and s is not None:
        add = (s.int().repeat_interleave(32, -1) - 127) * 128  # the exponent, bf16 bits
        bits = (value.bfloat16().view(torch.int16).int() + add) & 0xFFFF
        wrapped = bits.to(torch.int16).view(torch.bfloat16).float()
        wrapped = torch.where((value == 0) | value.isnan(), value, wrapped)
        assert _nan_aware_differ(got, _want(x, wrapped.bfloat16().expand(e, n, k), counts)) > 0


def test_amx_bodies_refuse_x_past_bf16_and_weights_not_exact_in_it() -> None:
    g = torch.Generator().manual_seed(4)
    w, _ = random_stored("e4m3", "e8m0", 1, 8, 64, g)
    x = torch.randn(3, 64, generator=g)  # fp32 values with more than bf16's 8 bits
    out = torch.full((3, 8), 7.0)
    scratch = torch.empty(cpu_fused.expert_gemm_scratch(3, 64))
    for vector in _bodies():
        with pytest.raises(ValueError, match="not exact in bf16"):
            cpu_fused.expert_gemm(x, None, groups([3]), w, out, scratch, vector=vector)
        assert (out == 7.0).all()  # nothing written
    fp32_scaled, _ = random_stored("e4m3", "fp32", 1, 8, 64, g)
    with pytest.raises(ValueError, match="needs weights exact in bf16"):
        cpu_fused.expert_gemm(x.bfloat16(), None, groups([3]), fp32_scaled, out, scratch,
                              vector="amx_scalar")  # fmt: skip


def _three_experts(h: int, inter: int, g: torch.Generator) -> MoEWeightPack:
    """Three experts' Gaussian weights, about unit-scale outputs."""
    return MoEWeightPack(torch.randn(3, 2 * inter, h, generator=g) / 11,
                         torch.randn(3, h, inter, generator=g) / 11)  # fmt: skip


@pytest.mark.parametrize("recipe_cls", [Mxfp8Recipe, Nvfp4Recipe, Fp8Fp4Recipe, Fp8BlockRecipe])
def test_run_experts_sends_quantized_experts_to_amx_whatever_their_rows(
    recipe_cls: type[Recipe], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the CPU has AMX, a quantized format whose operands are exact in bf16 runs every
    expert on the AMX body, under and over the crossover alike (not the fp32 order, not the
    fp32 `mm` blocks); elsewhere, and for a format that is not exact (fp8's fp32 scales),
    those under it on the default body and those over it on the `mm` blocks."""
    g = torch.Generator().manual_seed(11)
    h = 128
    recipe = recipe_cls()
    pw = recipe.prepare(_three_experts(h, 128, g))
    big = experts.expert_gemm_rows(pw, torch.device("cpu")) + 1  # the crossover: 16 or 64
    assert big > 3
    counts = [3, 0, big]  # under and over the crossover
    vectors: list[object] = []
    real = cpu_fused.expert_gemm

    def recorded(*args: Any, vector: Any = True, **kw: Any) -> bool:
        vectors.append(vector)
        return real(*args, vector=vector, **kw)

    monkeypatch.setattr(cpu_fused, "expert_gemm", recorded)
    mm_rows: list[int] = []
    real_mm = experts._mm

    def counted_mm(a: torch.Tensor, *args: Any) -> None:
        mm_rows.append(int(a.shape[0]))
        real_mm(a, *args)

    monkeypatch.setattr(experts, "_mm", counted_mm)
    rows = recipe.unpack(recipe.pack(torch.randn(50, h, generator=g)), h)
    src_row = torch.randint(0, 50, (sum(counts),), generator=g)
    y = torch.empty(sum(counts), h, dtype=torch.bfloat16)
    experts.run_experts(rows, src_row, counts, pw, recipe.requantize_into, None, y, Workspace())
    amx = recipe.operands_exact_in_bf16 and cpu_fused.amx_by_default()
    assert experts.amx_for_quantized(pw, torch.device("cpu")) == amx
    # FC1 and FC2 of both experts in one call each on AMX; else of the 3-row one
    assert vectors == (["amx", "amx"] if amx else [True, True])
    assert mm_rows == ([] if amx else [big, big])


@pytest.mark.parametrize("kernel", ["any_mxfp8_mxfp8_bf16_torch", "any_nvfp4_nvfp4_bf16_torch",
                                    "any_fp8_fp4_bf16_torch"])  # fmt: skip
def test_the_layer_with_experts_above_the_crossover_stays_within_the_oracle(kernel: str) -> None:
    """About 32 rows per expert (above the quantized crossover): on AMX CPUs those experts
    sum in the AMX order; the forward stays inside the format's oracle bound (which the
    planted faults of test_oracle_faults.py fail)."""
    g = torch.Generator().manual_seed(12)
    e, t, h, inter, k = 4, 64, 256, 128, 2
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    x, w = torch.randn(t, h, generator=g).bfloat16(), torch.rand(t, k, generator=g)
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    layer = MoEEpLayer(boot, FleetParams(e, t, h), MoEWeightPack(w13, w2), kernel)
    try:
        out = layer(MoEEpTensors(x, ids, w)).clone()
    finally:
        layer.destroy()
    fmt = {"any_mxfp8_mxfp8_bf16_torch": "mxfp8", "any_nvfp4_nvfp4_bf16_torch": "nvfp4",
           "any_fp8_fp4_bf16_torch": "fp8_fp4"}[kernel]  # fmt: skip
    report = compare_to_oracle(out, oracle_forward(x, ids, w, w13, w2, fmt=fmt))
    assert report.ok, report


def _random_e4m3(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Every e4m3fn byte but NaN."""
    codes = torch.randint(0, 256, shape, generator=g).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C
    return codes


def _random_scales(shape: tuple[int, ...], low: int, g: torch.Generator) -> torch.Tensor:
    """fp32 scales from 2^low to 2^10, not powers of two."""
    s = torch.pow(2.0, torch.randint(low, 11, shape, generator=g).float())
    return s * (1 + torch.rand(shape, generator=g))


def _scaled_sums(
    xv: torch.Tensor,
    wv: torch.Tensor,
    bs: int,
    scale: Callable[[int], torch.Tensor],
    fused: bool = True,
) -> torch.Tensor:
    """fp32 `[Q, N]`: per sum block b of `bs` elements the bf16 values `xv [Q, K]` times `wv
    [N, K]` summed in the AMX order from +0 (`reference_amx`), then `acc = fma(sum,
    scale(b), acc)` over the blocks from +0 (`scale(b)`: fp32 values as float64,
    broadcastable to `[Q, N]`), nothing flushed there. `fused=False`: a multiply then an
    add (a fault the tests show this catches)."""
    acc = torch.zeros(int(xv.shape[0]), int(wv.shape[0]), dtype=torch.float64)
    for b in range(int(xv.shape[1]) // bs):
        part = reference_amx(xv[:, b * bs : (b + 1) * bs], wv[:, b * bs : (b + 1) * bs]).double()
        if fused:  # the float64 sum rounds once before fp32 (a tie these data miss)
            acc = (acc + part * scale(b)).float().double()
        else:
            acc = (acc + (part * scale(b)).float().double()).float().double()
    return acc.float()


def reference_block_scaled(
    xc: torch.Tensor,
    xs: torch.Tensor,
    x_block: int,
    wc: torch.Tensor,
    ws: torch.Tensor,
    w_block: int,
    *,
    fused: bool = True,
    weight_scale: bool = True,
) -> torch.Tensor:
    """fp32 `[Q, N]` of e4m3 codes `xc [Q, K]` (scales `xs [Q, K / x_block]`) times `wc [N,
    K]` (per-row scales `ws [N, K / w_block]`) in the block-scaled AMX order: per sum block
    (the smaller block) the codes' values, scaled by `fp32(x scale * w scale)`
    (`_scaled_sums`). `weight_scale=False` plants a fault the tests show this catches."""
    xv, wv = xc.view(torch.float8_e4m3fn).bfloat16(), wc.view(torch.float8_e4m3fn).bfloat16()
    bs = min(x_block, w_block)

    def scale(b: int) -> torch.Tensor:
        sx = xs[:, b * bs // x_block].double()[:, None]
        sw = ws[:, b * bs // w_block].double()[None, :] if weight_scale else 1.0
        return (sx * sw).float().double()  # fp32(sx * sw): the float64 product is exact

    return _scaled_sums(xv, wv, bs, scale, fused)


def reference_x_scaled(
    xc: torch.Tensor, xs: torch.Tensor, x_block: int, w: torch.Tensor, fused: bool = True
) -> torch.Tensor:
    """The block-scaled order over weights exact in bf16 (`w [N, K]`, their values): per x
    block the x codes' values times w in the AMX order, scaled by the x scale."""
    xv = xc.view(torch.float8_e4m3fn).bfloat16()
    return _scaled_sums(xv, w, x_block, lambda b: xs[:, b].double()[:, None], fused)


def _block_scaled_case(
    counts: list[int], n: int, k: int, x_block: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, StoredWeight, torch.Tensor, torch.Tensor]:
    """x codes and scales, fp8 weights with fp32 per-row block scales of 128 (their codes
    and scales too)."""
    xc = _random_e4m3((sum(counts), k), g)
    xs = _random_scales((sum(counts), k // x_block), -60, g)
    wc = _random_e4m3((len(counts), n, k), g)
    ws = _random_scales((len(counts), n, k // 128), -70, g)
    return xc, xs, StoredWeight(wc, "e4m3", ws, "fp32", 128), wc, ws


def _run_block_scaled(
    xc: torch.Tensor,
    xs: torch.Tensor,
    x_block: int,
    w: StoredWeight,
    counts: list[int],
    vector: cpu_fused.Body,
    out_dtype: torch.dtype = torch.float32,
    alpha: torch.Tensor | None = None,
    x_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    rows = groups(counts)
    out = torch.full((rows.rows, w.n), 7.0, dtype=out_dtype)
    scratch = torch.empty(cpu_fused.expert_gemm_scratch(rows.rows, w.k))
    assert cpu_fused.expert_gemm(
        xc, x_rows, rows, w, out, scratch, alpha=alpha, vector=vector, x_scales=xs,
        x_block=x_block,
    )  # fmt: skip
    return out


def _bodies_give(
    expect: torch.Tensor,
    xc: torch.Tensor,
    xs: torch.Tensor,
    x_block: int,
    w: StoredWeight,
    counts: list[int],
    alpha: torch.Tensor,
    perm: torch.Tensor | None = None,
) -> None:
    """Both AMX bodies at one and two threads give `expect` in the block-scaled order, fp32
    and bf16 out; with `perm`, also from x rows gathered through `x_rows` (call row q is x's
    row perm[q])."""
    if perm is not None:
        xg, sg = torch.empty_like(xc), torch.empty_like(xs)
        xg[perm], sg[perm] = xc, xs

    def check(threads: int) -> None:
        for vector in _bodies():
            got = _run_block_scaled(xc, xs, x_block, w, counts, vector, alpha=alpha)
            assert differ(got, expect) == 0, vector
            got16 = _run_block_scaled(xc, xs, x_block, w, counts, vector, torch.bfloat16, alpha)
            assert differ(got16, expect.bfloat16()) == 0, vector
            if perm is not None:
                gathered = _run_block_scaled(xg, sg, x_block, w, counts, vector, alpha=alpha,
                                             x_rows=perm)  # fmt: skip
                assert differ(gathered, expect) == 0, vector

    at_one_and_two_threads(check)


@pytest.mark.parametrize(("n", "k", "x_block"), [(37, 256, 128), (70, 384, 64), (16, 2048, 128)])
def test_block_scaled_order_matches_its_emulation(n: int, k: int, x_block: int) -> None:
    """fp8's GEMMs from both operands' codes (`expert_gemm(x_scales=...)`, the AMX body and
    its twin, one and two threads): bit for bit the block-scaled emulation, over ragged
    groups (empty ones, partial and whole 16-row tiles, the 2 x 2 passes and more than one
    256-row item), scales from 2^-70 (products of scales subnormal), with alphas, x rows
    gathered (`x_rows`), fp32 and bf16 outputs; x blocks of 128 and of 64 (fp8's
    `fc2_act_block=64`)."""
    g = torch.Generator().manual_seed(n + k + x_block)
    counts = RAGGED
    xc, xs, w, wc, ws = _block_scaled_case(counts, n, k, x_block, g)
    alpha = torch.rand(len(counts), generator=g) + 0.5
    want, q0 = [], 0
    for e, rows in enumerate(counts):
        ref = reference_block_scaled(xc[q0 : q0 + rows], xs[q0 : q0 + rows], x_block, wc[e],
                                     ws[e], 128)  # fmt: skip
        want.append(ref * alpha[e])
        q0 += rows
    expect = torch.cat(want)
    perm = torch.randperm(sum(counts), generator=g)  # x_rows: row q of the call is x[perm[q]]
    _bodies_give(expect, xc, xs, x_block, w, counts, alpha, perm)
    # the comparison tells the order from a multiply then an add per block, from a missing
    # weight scale, and from the fp32 order on the dequantized values
    some = slice(0, sum(counts[:6]))
    unfused = torch.cat([reference_block_scaled(xc[some], xs[some], x_block, wc[0], ws[0], 128,
                                                fused=False)])  # fmt: skip
    fused = reference_block_scaled(xc[some], xs[some], x_block, wc[0], ws[0], 128)
    assert differ(unfused, fused) > 0
    assert differ(reference_block_scaled(xc[some], xs[some], x_block, wc[0], ws[0], 128,
                                         weight_scale=False), fused) > 0  # fmt: skip
    xd = quant.dequantize_fp8_blockwise(xc.view(torch.float8_e4m3fn), xs, block=(1, x_block))
    fp32_order = run(xd.float().contiguous(), w, counts, False, alpha=alpha)
    assert differ(fp32_order, expect) > 0


@pytest.mark.parametrize(
    ("code", "scale", "k", "x_block"),
    [("e2m1", "e8m0", 256, 256), ("e2m1", "e8m0", 384, 64), ("e4m3", None, 256, 256),
     ("e4m3", "e8m0", 128, 64), ("e2m1", "e4m3", 512, 512)],
)  # fmt: skip
def test_x_scaled_order_over_weights_exact_in_bf16(
    code: str, scale: str | None, k: int, x_block: int
) -> None:
    """The sm90 hybrids' GEMMs (e4m3 activations with one fp32 scale per token, or per 64
    for the FC2 input; weights the AMX order takes: mxfp4, nvfp4's e4m3 operand): both
    bodies at one and two threads, bit for bit the emulation (each x block's AMX-order sum
    of code values times the weights' values, then `fma(sum, x scale, acc)`), ragged
    groups, alphas, fp32 and bf16 out; other bits than the AMX order on the dequantized
    activations (which the AMX bodies refuse: not exact in bf16)."""
    g = torch.Generator().manual_seed(k + x_block + len(code))
    counts = [3, 0, 17, 1, 40, 16]
    w, deq = random_stored(code, scale, len(counts), 37, k, g)
    xc = _random_e4m3((sum(counts), k), g)
    xs = _random_scales((sum(counts), k // x_block), -60, g)
    alpha = torch.rand(len(counts), generator=g) + 0.5
    want, q0 = [], 0
    for e, rows in enumerate(counts):
        ref = reference_x_scaled(xc[q0 : q0 + rows], xs[q0 : q0 + rows], x_block,
                                 _bf16_exact(deq[e]))  # fmt: skip
        want.append(ref * alpha[e])
        q0 += rows
    _bodies_give(torch.cat(want), xc, xs, x_block, w, counts, alpha)
    if x_block < k:  # the comparison tells the step from a multiply then an add
        some = slice(sum(counts[:4]), sum(counts[:5]))  # the 40-row group
        fused = reference_x_scaled(xc[some], xs[some], x_block, _bf16_exact(deq[4]))
        unfused = reference_x_scaled(xc[some], xs[some], x_block, _bf16_exact(deq[4]), False)
        assert differ(unfused, fused) > 0


def test_block_scaled_order_refuses_what_it_cannot_sum() -> None:
    """Bad operands are refused with the argument, the value and the rule, nothing written."""
    g = torch.Generator().manual_seed(21)
    xc, xs, w, _, _ = _block_scaled_case([4], 16, 256, 128, g)
    out = torch.full((4, 16), 7.0)
    scratch = torch.empty(cpu_fused.expert_gemm_scratch(4, 256))

    def call(
        x: torch.Tensor, s: torch.Tensor, block: int, weight: StoredWeight, vector: Any
    ) -> None:
        cpu_fused.expert_gemm(x, None, groups([4]), weight, out, scratch, vector=vector,
                              x_scales=s, x_block=block)  # fmt: skip

    with pytest.raises(ValueError, match="vector must be one of amx, amx_scalar"):
        call(xc, xs, 128, w, True)
    with pytest.raises(ValueError, match=r"x_block=48 \(and fp32-scaled weights' block 128\)"):
        call(xc, xs, 48, w, "amx_scalar")
    with pytest.raises(ValueError, match=r"x_scales must be fp32 \[4, 2\]"):
        call(xc, xs[:, :1].contiguous(), 128, w, "amx_scalar")
    with pytest.raises(ValueError, match="x as \\[R, 256\\] e4m3 codes"):
        call(xc.float(), xs, 128, w, "amx_scalar")
    fp32_e2m1, _ = random_stored("e2m1", "fp32", 1, 16, 256, g)  # neither kind the order takes
    with pytest.raises(ValueError, match="or weights exact in bf16, got e2m1 with fp32"):
        call(xc, xs, 128, fp32_e2m1, "amx_scalar")
    assert (out == 7.0).all()


@pytest.mark.parametrize("recipe_cls", [Fp8BlockRecipe, Fp8Mxfp4Recipe, Fp8Nvfp4Recipe])
def test_run_experts_takes_the_rows_codes_in_the_block_scaled_order(
    recipe_cls: type[Recipe], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp8 and the sm90 hybrids' rows handed over with their codes (`Dispatched.codes`) on a
    CPU with AMX: every expert (under and over the crossover) runs both GEMMs in the
    block-scaled order, FC2 on the SwiGLU output quantized as the recipe quantizes it; the
    output equals that order's emulation over the eager quantization, bit for bit (the
    hybrids' nvfp4 with its alphas). An explicit crossover (`expert_gemm_rows`) keeps the
    dequantized rows' paths."""
    if not cpu_fused.block_scaled_by_default():
        pytest.skip("the block-scaled order runs only where the CPU has AMX")
    g = torch.Generator().manual_seed(12)
    h, inter = 256, 128
    recipe = recipe_cls()
    pw = recipe.prepare(_three_experts(h, inter, g))
    s13, s2 = pw.stored13, pw.stored2
    assert s13 is not None and s2 is not None
    payload = recipe.pack(torch.randn(50, h, generator=g) * 3)
    rows, codes = recipe.unpack(payload, h), recipe.codes_of(payload, h)
    counts = [3, 0, 40]
    src_row = torch.randint(0, 50, (sum(counts),), generator=g)
    calls: list[tuple[object, bool]] = []
    real = cpu_fused.expert_gemm

    def recorded(*args: Any, vector: Any = True, **kw: Any) -> bool:
        calls.append((vector, kw.get("x_scales") is not None))
        return real(*args, vector=vector, **kw)

    monkeypatch.setattr(cpu_fused, "expert_gemm", recorded)
    y = torch.empty(sum(counts), h, dtype=torch.bfloat16)
    spec = recipe.fake_quant
    assert spec is not None
    experts.run_experts(rows, src_row, counts, pw, recipe.requantize_into, None, y, Workspace(),
                        codes=codes, fc2_codes=spec)  # fmt: skip
    assert calls == [("amx", True), ("amx", True)]

    def gemm(xc: torch.Tensor, xs: torch.Tensor, x_block: int, w: StoredWeight, wt: torch.Tensor,
             e: int, alpha: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        if w.scale == "fp32":  # fp8: both operands' scales per block
            assert w.scales is not None
            out = reference_block_scaled(xc, xs, x_block, w.codes[e], w.scales[e], w.block)
        else:  # weights exact in bf16: their values
            out = reference_x_scaled(xc, xs, x_block, _bf16_exact(wt[e].t()))
        return out if alpha is None else out * alpha[e]

    xc, xs = codes.codes[src_row], codes.scales[src_row]
    want, q0 = [], 0
    for e, n in enumerate(counts):
        sl = slice(q0, q0 + n)
        gu = gemm(xc[sl], xs[sl], codes.block, s13, pw.w13t, e, pw.alpha13)
        hid = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        hc, hs = (
            quant.quantize_fp8_fc2_hybrid(hid, check_finite=False)
            if spec.kind == "fp8_hybrid"
            else quant.quantize_fp8_blockwise(hid, block=(1, spec.block), check_finite=False)
        )
        out = gemm(hc.view(torch.uint8), hs, spec.block, s2, pw.w2t, e, pw.alpha2)
        want.append(out.bfloat16())
        q0 += n
    assert differ(y, torch.cat(want)) == 0
    calls.clear()
    experts.run_experts(rows, src_row, counts, pw, recipe.requantize_into, None, y, Workspace(),
                        codes=codes, fc2_codes=spec, gemm_rows=16)  # fmt: skip
    assert calls == [(True, False), (True, False)]  # the 3-row expert in the fp32 order

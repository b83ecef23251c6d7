"""`normal_scales=True` of the mx quantizers (the sm100 MXFP4 x MXFP8 kernel's rule: E8M0
exponents floored at -126) and the `any_mxfp8_mxfp4_bf16_torch` recipe, bit for bit against
scalar references written here from the OCP MX block format (quant_ref's exact codecs) and
against the kernel's own exponent formula, `cvt.rp(max(fp32(amax * fp32(1/fmax)), 2**-126))`."""

from __future__ import annotations

import pytest
import torch
from quant_ref import decode_e2m1, decode_e4m3, encode, exact_ceil_log2_ratio, f32, pack_nibbles

import moe_ep.quant as q
from moe_ep.errors import MoeEpUsageError

FMAX = {"e4m3": 448.0, "e2m1": 6.0}
EMAX = {"e4m3": 8, "e2m1": 2}


def kernel_byte(amax: float, fmt: str) -> int:
    """The E8M0 byte the kernel's staging (and its host weight quantizer) computes: the fp32
    product amax * fp32(1 / fmax), floored at 2**-126, rounded up to a power of two."""
    v = max(f32(amax * f32(1.0 / FMAX[fmt])), 2.0**-126)
    return min(exact_ceil_log2_ratio(v, 1.0), 127) + 127


def ref_block(vals: list[float], fmt: str, *, normal: bool) -> tuple[list[int], int]:
    """One 32-block: e = ceil(log2(amax / fmax)) exactly (at least -126 with `normal`, else
    -127), elements RNE(v * 2**-e) saturating; an all-zero block byte 1 (`normal`) or 0."""
    amax = max(abs(v) for v in vals)
    if amax == 0:
        return [encode(v, fmt) for v in vals], 1 if normal else 0
    e = max(-126 if normal else -127, min(127, exact_ceil_log2_ratio(amax, FMAX[fmt])))
    return [encode(f32(v * 2.0**-e), fmt) for v in vals], e + 127


def _bf16_amaxes() -> torch.Tensor:
    """Every positive finite bf16 value, as float32."""
    return torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def _fp32_amaxes(n: int, seed: int) -> torch.Tensor:
    """Random positive finite fp32 bit patterns (subnormals included) plus powers of two
    times 448 and 6 and their fp32 neighbours, where a rounded product could cross a binade."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(1, 0x7F800000, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([f * 2.0**k for f in (448.0, 6.0) for k in range(-140, 120)])
    edges = edges[(edges > 0) & torch.isfinite(edges.float())].float()
    up = torch.nextafter(edges, torch.tensor(float("inf")))
    down = torch.nextafter(edges, torch.tensor(0.0))
    return torch.cat([bits.view(torch.float32), edges, up, down])


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
def test_exact_ceil_with_the_floor_is_the_kernels_rounded_product(fmt: str) -> None:
    amax = torch.cat([_bf16_amaxes(), _fp32_amaxes(20000, seed=1)])
    _, got = q.mx_block_exponents(
        amax, fmax=FMAX[fmt], emax=EMAX[fmt], rule="ceil", normal_scales=True
    )
    want = torch.tensor([kernel_byte(a, fmt) for a in amax.tolist()], dtype=torch.uint8)
    assert torch.equal(got, want)
    _, zero = q.mx_block_exponents(
        torch.zeros(2), fmax=FMAX[fmt], emax=EMAX[fmt], rule="ceil", normal_scales=True
    )
    assert zero.tolist() == [1, 1] == [kernel_byte(0.0, fmt)] * 2
    # without the floor the tiny amaxes get byte 0 (2**-127), not the kernel's 1
    _, plain = q.mx_block_exponents(amax, fmax=FMAX[fmt], emax=EMAX[fmt], rule="ceil")
    assert bool((plain != got).any()) and int(plain.min()) == 0


def _blocks(seed: int) -> torch.Tensor:
    """[4, 8, 64]: magnitudes 2**-140 .. 2**20 per 32-block (the floor binds below about
    448 * 2**-127 / 6 * 2**-127), an all-zero block, a block of -0 and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 8, 64, generator=g)
    x *= (
        torch.exp2(torch.randint(-140, 20, (4, 8, 2, 1), generator=g).float())
        .repeat_interleave(32, -1)
        .view(4, 8, 64)
    )
    x[0, 0, :32] = 0.0
    x[0, 1, :32] = -0.0
    x[0, 1, 3] = -1e-38
    return x


def test_mxfp8_and_mxfp4_with_normal_scales_match_the_reference() -> None:
    x = _blocks(2)
    d8, s8 = q.quantize_mxfp8(x, normal_scales=True)
    p4, s4 = q.quantize_mxfp4(x, normal_scales=True)
    floored = 0
    for e in range(4):
        for r in range(8):
            codes4 = []
            for b in range(2):
                vals = x[e, r, 32 * b : 32 * b + 32].tolist()
                c8, b8 = ref_block(vals, "e4m3", normal=True)
                assert int(s8[e, r, b]) == b8, (e, r, b)
                assert d8[e, r, 32 * b : 32 * b + 32].view(torch.uint8).tolist() == c8
                c4, b4 = ref_block(vals, "e2m1", normal=True)
                assert int(s4[e, r, b]) == b4, (e, r, b)
                codes4 += c4
                floored += ref_block(vals, "e4m3", normal=False)[1] != b8
            assert p4[e, r].tolist() == pack_nibbles(codes4), (e, r)
    assert floored > 2  # the floor changed some bytes here
    assert not torch.equal(q.quantize_mxfp8(x)[0].view(torch.uint8), d8.view(torch.uint8))


def test_normal_scales_must_be_a_bool() -> None:
    with pytest.raises(MoeEpUsageError, match="normal_scales must be a bool"):
        q.quantize_mxfp8(torch.ones(1, 32), normal_scales=1)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the portable recipe


def test_recipe_payload_fc2_input_and_weights_are_the_kernel_rules() -> None:
    from moe_ep.backends.portable.recipes import Mxfp8Mxfp4Recipe
    from moe_ep.types import MoEWeightPack

    recipe = Mxfp8Mxfp4Recipe()
    x = _blocks(3).view(32, 64)
    payload = recipe.pack(x)  # bf16-exact inputs are not needed: the rule is on fp32
    assert payload.shape == (32, recipe.row_bytes(64)) == (32, 66)
    for r in range(32):
        codes, bytes_ = [], []
        for b in range(2):
            c, s = ref_block(x[r, 32 * b : 32 * b + 32].tolist(), "e4m3", normal=True)
            codes += c
            bytes_.append(s)
        assert payload[r].tolist() == codes + bytes_, r
    # the FC2 input: the kernel's epilogue has no floor (cvt.rp.satfinite of the product)
    h = _blocks(4).view(32, 64)
    want = []
    for r in range(32):
        row = []
        for b in range(2):
            c, s = ref_block(h[r, 32 * b : 32 * b + 32].tolist(), "e4m3", normal=False)
            row += [decode_e4m3(v) * 2.0 ** (s - 127) for v in c]
        want.append(row)
    assert torch.equal(recipe.requantize(h).float(), torch.tensor(want, dtype=torch.float32))
    # weights: mxfp4 with normal scales, from bf16 and from the pre-quantized pack
    w13, w2 = _blocks(5), _blocks(6)
    prepared = recipe.prepare(MoEWeightPack(w13=w13, w2=w2))
    for got, w in ((prepared.w13t, w13), (prepared.w2t, w2)):
        ref = []
        for e in range(4):
            rows = []
            for r in range(8):
                row = []
                for b in range(2):
                    c, s = ref_block(w[e, r, 32 * b : 32 * b + 32].tolist(), "e2m1", normal=True)
                    row += [decode_e2m1(v) * 2.0 ** (s - 127) for v in c]
                rows.append(row)
            ref.append(rows)
        assert torch.equal(got.transpose(1, 2), torch.tensor(ref, dtype=torch.float32))
    p13, s13 = q.quantize_mxfp4(w13, normal_scales=True)
    p2, s2 = q.quantize_mxfp4(w2, normal_scales=True)
    pre = recipe.prepare(MoEWeightPack(p13, p2, s13, s2))
    assert torch.equal(pre.w13t, prepared.w13t) and torch.equal(pre.w2t, prepared.w2t)
    with pytest.raises(MoeEpUsageError, match="multiples of 128"):
        recipe.check_dims(128, 64)

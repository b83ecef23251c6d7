"""`sm100_mxfp8_mxfp4_bf16_cutedsl` on CPU: config refusals, the kernel-ready mxfp4 weights
against a plain-Python reference written from the layout's definition (e2m1 code table,
ceil-rule E8M0 exponent, nibble order, 16-row gate/up stripes, K-major views, the CUTLASS
128x4 scale-factor atom), pre-quantized packs, a round trip, and the mxfp8 input staging."""

from __future__ import annotations

import math

import pytest
import torch
from backend_testing import assert_gpu_staging_equals_cpu

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig as Config,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import padded_tokens_per_rank
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.layout import (
    prepare_mxfp4_weights,
    stage_mxfp8_inputs,
)

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
GOOD = dict(
    hidden_size=256, intermediate_size=128, top_k=8, num_experts=16, world_size=2,
    max_tokens_per_rank=64,
)  # fmt: skip


# -- reference, from the definitions ----------------------------------------------------
def ref_exponent(amax: float, fmax: float = 6.0) -> int:
    """Smallest e >= -126 with amax / 2**e <= fmax (ceil(log2(amax / fmax)), exact, floored
    at the smallest normal exponent: the kernel's scales are normal fp32; -126 for a zero
    block)."""
    if amax == 0:
        return -126
    e = math.frexp(amax / fmax)[1]
    while math.ldexp(amax, -(e - 1)) <= fmax:
        e -= 1
    while math.ldexp(amax, -e) > fmax:
        e += 1
    return max(e, -126)


def ref_code(v: float) -> int:
    """e2m1 code of v (already divided by the block scale): nearest, ties to the even code,
    saturating at 6; the sign bit is v's (so -0.0 and negatives rounding to 0 give code 8, as
    the GPU's cvt.rn.satfinite.e2m1x2 does: docs/quant.md)."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - mag), c % 2))
    return best | (8 if math.copysign(1.0, v) < 0 else 0)


def ref_mxfp4_row(row: list[float]) -> tuple[list[int], list[int]]:
    """(e2m1 codes, E8M0 bytes) of one row, blocks of 32."""
    codes, scales = [], []
    for b in range(0, len(row), 32):
        block = row[b : b + 32]
        amax = max(abs(x) for x in block)
        e = ref_exponent(amax)
        scales.append(e + 127)
        codes += [ref_code(math.ldexp(x, -e)) for x in block]
    return codes, scales


def kernel_row_to_canonical(r: int, i: int) -> int:
    """FC1 row r of the kernel (stripes of 16: gate, up, gate, ...) -> canonical row."""
    stripe, within = divmod(r, 16)
    pair, which = divmod(stripe, 2)
    return which * i + pair * 16 + within


def sf_offset(r: int, c: int, cols: int) -> int:
    """Byte of scale (row r, col c) in one 128x4-swizzled plane with `cols` logical columns."""
    col_tiles = -(-cols // 4)
    tile = (r // 128) * col_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


def check_leg(data: torch.Tensor, sf: torch.Tensor, codes, scales, rows: int, k: int) -> None:
    """Kernel view `data [E, K/2, N]` uint8 and `sf [E, plane]` hold `codes[e][n][k]`,
    `scales[e][n][k/32]`."""
    assert data.stride(1) == 1, "K-major: stride 1 along K"
    assert data.dtype == torch.uint8 and sf.dtype == torch.uint8
    d, s = data.tolist(), sf.tolist()
    for e in range(len(codes)):
        for n in range(rows):
            for kk in range(0, k, 2):
                want = codes[e][n][kk] | (codes[e][n][kk + 1] << 4)
                assert d[e][kk // 2][n] == want, (e, n, kk)
            for c in range(k // 32):
                assert s[e][sf_offset(n, c, k // 32)] == scales[e][n][c], (e, n, c)


def weights(e: int = 2, h: int = 128, i: int = 128, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) * torch.logspace(-3, 2, h).view(1, 1, h)
    w2 = torch.randn(e, h, i, generator=g)
    w13[0, 3, :32] = 0  # a zero block: byte 1
    w13[0, 4, :32] *= 2.0**-130  # a block whose ceil exponent is below -126
    w13[0, 5, :32] = w13[0, 5, :32].clamp(-0.7, 0.7)
    w13[0, 5, 7] = 6.0 * 2**-3  # a block whose max is exactly 6 * 2**e
    return w13.bfloat16().float(), w2.bfloat16().float()


# -- weights --------------------------------------------------------------------------
def test_fc1_weights_match_the_layout_definition() -> None:
    w13, w2 = weights()
    e, two_i, h = w13.shape
    i = two_i // 2
    got = prepare_mxfp4_weights(w13, w2)
    codes, scales = [], []
    for ex in range(e):
        canonical = [kernel_row_to_canonical(r, i) for r in range(two_i)]
        rows = [ref_mxfp4_row(w13[ex, n].tolist()) for n in canonical]
        codes.append([c for c, _ in rows])
        scales.append([s for _, s in rows])
    assert tuple(got.w13.shape) == (e, h // 2, two_i)
    assert tuple(got.w13_scales.shape) == (e, 256 * 4)  # ceil128(2I) * ceil4(H/32)
    check_leg(got.w13, got.w13_scales, codes, scales, two_i, h)


def test_fc2_weights_match_the_layout_definition() -> None:
    w13, w2 = weights(e=1, h=256)
    e, h, i = w2.shape
    got = prepare_mxfp4_weights(w13, w2)
    rows = [[ref_mxfp4_row(w2[ex, n].tolist()) for n in range(h)] for ex in range(e)]
    assert tuple(got.w2.shape) == (e, i // 2, h)
    assert tuple(got.w2_scales.shape) == (e, 256 * 4)
    check_leg(got.w2, got.w2_scales, [[c for c, _ in r] for r in rows],
              [[s for _, s in r] for r in rows], h, i)  # fmt: skip


def test_prequantized_packs_are_laid_out_without_requantizing() -> None:
    g = torch.Generator().manual_seed(1)
    e, h, i = 1, 128, 128
    q13 = torch.randint(0, 256, (e, 2 * i, h // 2), generator=g, dtype=torch.uint8)
    s13 = torch.randint(100, 140, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8)
    q2 = torch.randint(0, 256, (e, h, i // 2), generator=g, dtype=torch.uint8)
    s2 = torch.randint(100, 140, (e, h, i // 32), generator=g, dtype=torch.uint8)
    got = prepare_mxfp4_weights(q13, q2, s13.view(torch.float8_e8m0fnu), s2)
    nib = lambda q, ex, n: [v for b in q[ex, n].tolist() for v in (b & 15, b >> 4)]  # noqa: E731
    codes13 = [[nib(q13, 0, kernel_row_to_canonical(r, i)) for r in range(2 * i)]]
    scales13 = [[s13[0, kernel_row_to_canonical(r, i)].tolist() for r in range(2 * i)]]
    check_leg(got.w13, got.w13_scales, codes13, scales13, 2 * i, h)
    check_leg(got.w2, got.w2_scales, [[nib(q2, 0, n) for n in range(h)]],
              [[s2[0, n].tolist() for n in range(h)]], h, i)  # fmt: skip


def test_bf16_and_prequantized_paths_agree_and_round_trip() -> None:
    from moe_ep.quant import (
        deinterleave_gate_up,
        dequantize_mxfp4,
        e8m0_to_float32,
        quantize_mxfp4,
        unswizzle_128x4,
    )

    w13, w2 = weights(seed=3)
    from_bf16 = prepare_mxfp4_weights(w13.bfloat16(), w2.bfloat16())
    (q13, s13), (q2, s2) = (quantize_mxfp4(w, normal_scales=True) for w in (w13, w2))
    from_pack = prepare_mxfp4_weights(q13, q2, s13, s2)
    for name in ("w13", "w13_scales", "w2", "w2_scales"):
        assert torch.equal(getattr(from_bf16, name), getattr(from_pack, name)), name
    # undo the layout: the canonical codes and scales come back, and dequantize close to w
    e, two_i, h = w13.shape
    back_q = deinterleave_gate_up(from_bf16.w13.permute(0, 2, 1).contiguous(), 16)
    back_s = deinterleave_gate_up(unswizzle_128x4(from_bf16.w13_scales, two_i, h // 32), 16)
    assert torch.equal(back_q, q13) and torch.equal(back_s, s13)
    deq = dequantize_mxfp4(back_q, back_s)
    # e2m1 error <= half the widest step (2, between 4 and 6) times the block scale 2**e
    scale = e8m0_to_float32(back_s).unsqueeze(-1)
    assert ((deq - w13).view(e, two_i, h // 32, 32).abs() <= scale).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(w13=torch.zeros(1, 256, 128, dtype=torch.float16)), "must be bf16/fp32"),
        (dict(w2=torch.zeros(1, 128, 64)), "must be \\[E_local, 2I, H\\]"),
        (dict(w13=torch.zeros(1, 80, 128), w2=torch.zeros(1, 128, 40)), "multiple of 16"),
        (dict(w13=torch.zeros(1, 96, 128), w2=torch.zeros(1, 128, 48)), "I must be a multiple"),
    ],
)
def test_bad_weights_are_refused(kwargs: dict, match: str) -> None:
    args = dict(w13=torch.zeros(1, 256, 128), w2=torch.zeros(1, 128, 128)) | kwargs
    with pytest.raises(MoeEpUsageError, match=match):
        prepare_mxfp4_weights(args["w13"], args["w2"])


def test_prequantized_scale_shape_is_checked() -> None:
    q13 = torch.zeros(1, 256, 64, dtype=torch.uint8)
    q2 = torch.zeros(1, 128, 64, dtype=torch.uint8)
    with pytest.raises(MoeEpUsageError, match="given together"):
        prepare_mxfp4_weights(q13, q2, torch.zeros(1, 256, 4, dtype=torch.uint8))
    with pytest.raises(MoeEpUsageError, match=r"w13_scale must be \[1, 256, 4\]"):
        prepare_mxfp4_weights(q13, q2, torch.zeros(1, 256, 2, dtype=torch.uint8),
                              torch.zeros(1, 128, 4, dtype=torch.uint8))  # fmt: skip


# -- staging --------------------------------------------------------------------------
def test_staging_quantizes_e4m3_with_linear_e8m0_and_masks_routes() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 256, generator=g) * 10
    x[1, 64:96] = 0  # a zero block: byte 1
    x[2, 96:128] *= 2.0**-135  # below the smallest normal scale
    x = x.bfloat16()
    ids = torch.tensor([[0, -1], [5, 2], [-1, -1]])
    wts = torch.tensor([[0.5, 0.9], [0.25, 0.75], [0.3, 0.4]])
    s = stage_mxfp8_inputs(x, ids, wts, max_tokens=4)
    assert s.activation.dtype == torch.float8_e4m3fn and tuple(s.activation.shape) == (4, 256)
    assert tuple(s.activation_scales.shape) == (4, 16)  # ceil16(256 / 32)
    for t in range(3):
        for b in range(8):
            block = x[t, 32 * b : 32 * b + 32].float().tolist()
            e = ref_exponent(max(abs(v) for v in block), 448.0)
            assert s.activation_scales[t, b].item() == e + 127, (t, b)
            want = torch.tensor([math.ldexp(v, -e) for v in block]).to(torch.float8_e4m3fn)
            assert torch.equal(s.activation[t, 32 * b : 32 * b + 32].view(torch.uint8),
                               want.view(torch.uint8))  # fmt: skip
    assert not s.activation_scales[:, 8:].any() and not s.activation_scales[3].any()
    assert not s.activation[3].view(torch.uint8).any()
    assert s.topk_ids.dtype == torch.int32
    assert s.topk_ids.tolist() == [[0, -1], [5, 2], [-1, -1], [-1, -1]]
    assert s.topk_weights.tolist() == [[0.5, 0.0], [0.25, 0.75], [0.0, 0.0], [0.0, 0.0]]


# -- config ---------------------------------------------------------------------------
def test_config_carries_the_taxonomy_name_and_refuses_other_combines() -> None:
    assert Config().kernel_name == "sm100_mxfp8_mxfp4_bf16_cutedsl"
    Config().check_problem(**GOOD)
    with pytest.raises(MoeEpUsageError, match="combine_dtype must be one of \\('bf16',\\)"):
        Config(combine_dtype="mxfp8")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(hidden_size=192), "hidden_size must be a multiple of 128"),
        (dict(intermediate_size=64), "intermediate_size must be a multiple of 128"),
        (dict(top_k=257, num_experts=512), "top_k must be <= 256"),
        (dict(world_size=512, num_experts=512), "world_size must be <= 256"),
        (dict(num_experts=32768), "num_experts must be <= 16384"),
        (dict(max_tokens_per_rank=65537, top_k=1), "max_tokens_per_rank must be <= 65536"),
        (dict(max_tokens_per_rank=65536, top_k=64, num_experts=64), "<= 2097152 routes"),
    ],
)
def test_config_refuses_what_the_kernel_cannot_run(change: dict, match: str) -> None:
    with pytest.raises(MoeEpUsageError, match=match):
        Config().check_problem(**(GOOD | change))


def test_config_top_k_must_match_the_inputs() -> None:
    with pytest.raises(MoeEpUsageError, match="differs from the config's top_k"):
        Config(top_k=4).check_problem(**GOOD)


def test_padded_tokens_make_routes_a_multiple_of_four() -> None:
    assert [padded_tokens_per_rank(5, k) for k in (1, 2, 3, 4, 6, 8)] == [8, 6, 8, 5, 6, 5]


# -- on a CUDA device (any arch; the H200 of the GPU check) ----------------------------
@pytest.mark.gpu
def test_gpu_staging_bytes_equal_cpu_bytes() -> None:
    assert_gpu_staging_equals_cpu(stage_mxfp8_inputs, 256)


@pytest.mark.gpu
def test_gpu_weight_preparation_equals_cpu_bytes() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (any arch); none visible")
    w13, w2 = weights(seed=4)
    cpu = prepare_mxfp4_weights(w13.bfloat16(), w2.bfloat16())
    gpu = prepare_mxfp4_weights(w13.bfloat16().cuda(), w2.bfloat16().cuda())
    for name in ("w13", "w13_scales", "w2", "w2_scales"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name

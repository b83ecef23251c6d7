"""Kernel-ready mxfp8 weights and staged inputs of the sm100 mxfp8 kernel, on CPU.

Independent expectations: a per-block scalar reference of the ceil-rule E8M0 recipe, the
swizzle offset formula written out, and the portable backend's mxfp8 weights (which the
kernel's must equal exactly, since the gate/up row interleave commutes with row-wise
quantization).
"""

from __future__ import annotations

import math

import pytest
import torch
from backend_testing import assert_gpu_staging_equals_cpu, require_drop, run_fresh_python
from layout_references import dequantize_mxfp8_weights

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.layout import (
    prepare_mxfp8_weights,
    stage_mxfp8_inputs,
)

E, I, H = 2, 192, 256  # noqa: E741 - the glossary names (I = intermediate)


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
    return w13, w2


def _e8m0_ref(block: torch.Tensor) -> int:
    """Scalar reference: byte = 127 + ceil(log2(amax / 448)), 0 for an all-zero block."""
    amax = float(block.abs().max())
    if amax == 0:
        return 0
    exp = math.ceil(math.log2(amax / 448.0))
    while 2.0 ** (exp - 1) * 448.0 >= amax:  # guard float log2 rounding up
        exp -= 1
    while 2.0**exp * 448.0 < amax:
        exp += 1
    return exp + 127


def test_weights_layout_and_scale_bytes():
    w13, w2 = _weights()
    p = prepare_mxfp8_weights(w13, w2)
    assert p.w13.shape == (E, H, 2 * I) and p.w13.stride(1) == 1
    assert p.w2.shape == (E, I, H) and p.w2.stride(1) == 1
    n_pad, c_pad = -(-2 * I // 128) * 128, -(-(H // 32) // 4) * 4
    assert p.w13_scales.shape == (E, n_pad * c_pad)
    # Kernel row n of FC1: block pair n // 64, gate if (n % 64) < 32 else up.
    for n in (0, 31, 32, 63, 64, 2 * I - 1):
        pair, lane = divmod(n, 64)
        row = pair * 32 + lane % 32 + (I if lane >= 32 else 0)
        for c in (0, H // 32 - 1):
            want = _e8m0_ref(w13[1, row, 32 * c : 32 * c + 32].float())
            # 128x4 tile offset: (r % 32) * 16 + ((r // 32) % 4) * 4 + c % 4, tiles row-major.
            tile = (n // 128) * (c_pad // 4) + c // 4
            off = tile * 512 + (n % 32) * 16 + ((n // 32) % 4) * 4 + c % 4
            assert int(p.w13_scales[1, off]) == want, (n, c)


def test_weights_equal_the_portable_mxfp8_recipe_exactly():
    from moe_ep.backends.portable.recipes import Mxfp8Recipe
    from moe_ep.types import MoEWeightPack

    w13, w2 = _weights(1)
    got13, got2 = dequantize_mxfp8_weights(prepare_mxfp8_weights(w13, w2))
    portable = Mxfp8Recipe().prepare(MoEWeightPack(w13=w13, w2=w2))
    assert torch.equal(got13.transpose(1, 2), portable.w13t)
    assert torch.equal(got2.transpose(1, 2), portable.w2t)


def test_prequantized_pack_is_relaid_out_without_requantizing():
    from moe_ep.quant import quantize_mxfp8

    w13, w2 = _weights(2)
    q13, s13 = quantize_mxfp8(w13)
    q2, s2 = quantize_mxfp8(w2)
    a = prepare_mxfp8_weights(q13, q2, s13, s2)
    b = prepare_mxfp8_weights(w13, w2)
    assert torch.equal(a.w13.view(torch.uint8), b.w13.view(torch.uint8))
    assert torch.equal(a.w13_scales, b.w13_scales)
    assert torch.equal(a.w2_scales, b.w2_scales)
    with pytest.raises(MoeEpUsageError, match="w13_scale"):
        prepare_mxfp8_weights(q13, q2, s13[..., :-1], s2)


def test_a_non_contiguous_prequantized_w2_is_laid_out_k_major():
    # A pack whose w2 is a view with other strides (here [E, H, I] stored as [E, I, H]) is
    # laid out as the contiguous one: the kernel reads fc2 with stride 1 along K (I).
    from moe_ep.quant import quantize_mxfp8

    w13, w2 = _weights(3)
    q13, s13 = quantize_mxfp8(w13)
    q2, s2 = quantize_mxfp8(w2)
    strided = q2.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(strided.view(torch.uint8), q2.view(torch.uint8))
    assert not strided.is_contiguous()
    got = prepare_mxfp8_weights(q13, strided, s13, s2)
    want = prepare_mxfp8_weights(q13, q2, s13, s2)
    assert got.w2.stride(1) == 1 and tuple(got.w2.shape) == (E, I, H)
    assert torch.equal(got.w2.view(torch.uint8), want.w2.view(torch.uint8))


def test_staging_bytes():
    g = torch.Generator().manual_seed(3)
    n, t, k = 3, 8, 4
    x = (torch.randn(n, H, generator=g) * 3).to(torch.bfloat16)
    ids = torch.randint(0, 8, (n, k), generator=g, dtype=torch.int32)
    ids[1, 2] = -1
    w = torch.rand(n, k, generator=g)
    s = stage_mxfp8_inputs(x, ids, w, max_tokens=t)
    assert s.activation_scales.shape == (t, 8) and s.activation_scales.dtype == torch.uint8
    for r in range(n):
        for c in range(H // 32):
            blk = x[r, 32 * c : 32 * c + 32].float()
            byte = _e8m0_ref(blk)
            assert int(s.activation_scales[r, c]) == byte
            scale = 2.0 ** (byte - 127)
            want = (blk / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert torch.equal(
                s.activation[r, 32 * c : 32 * c + 32].view(torch.uint8), want.view(torch.uint8)
            )
    assert torch.all(s.activation[n:].view(torch.uint8) == 0)
    assert s.topk_ids.dtype == torch.int64 and torch.all(s.topk_ids[n:] == -1)
    assert torch.equal(s.topk_ids[:n], ids.long())
    assert s.topk_weights[1, 2] == 0 and torch.all(s.topk_weights[n:] == 0)


def test_zero_tokens_and_shape_errors():
    s = stage_mxfp8_inputs(
        torch.zeros(0, H, dtype=torch.bfloat16),
        torch.zeros(0, 2, dtype=torch.int64),
        torch.zeros(0, 2),
        max_tokens=4,
    )
    assert s.num_tokens == 0 and torch.all(s.topk_ids == -1)
    with pytest.raises(MoeEpUsageError, match="max_tokens=2"):
        stage_mxfp8_inputs(
            torch.zeros(3, H, dtype=torch.bfloat16),
            torch.zeros(3, 2, dtype=torch.int64),
            torch.zeros(3, 2),
            max_tokens=2,
        )
    with pytest.raises(MoeEpUsageError, match="multiple of 32"):
        prepare_mxfp8_weights(torch.zeros(E, 2 * I, 100), torch.zeros(E, 100, I))


_CROSS_CHECK = r"""
import json, torch
import moe_ep_drop_sm100_cutedsl as drop
from moe_ep.quant import quantize_mxfp8, swizzle_128x4
rc = drop.import_src_module("moe_nvfp4_swapab.runner_common")
hu = drop.import_src_module("common.host_utils")
g = torch.Generator().manual_seed(0)
plane = torch.randint(0, 255, (200, 7), generator=g, dtype=torch.uint8)
swizzle_ok = torch.equal(swizzle_128x4(plane), rc.to_blocked(plane))
x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
x[3] = 0.0
# block maxima on and next to the scale thresholds 1.75 * 2**k (e4m3's max 448 = 1.75 * 2**8,
# scaled), where a recipe through an inexact log2 picks the neighbouring exponent
edges = torch.tensor([448.0 * 2.0**j for j in range(-20, 12, 3)])
edges = torch.stack([edges, torch.nextafter(edges, edges * 2), torch.nextafter(edges, edges / 2)])
x[4:7] *= 1e-9
x[4:7, ::32] = edges[:, :8]
ours = quantize_mxfp8(x)
theirs = hu.mxfp8_quantize_per_block_32_row(x, torch.float8_e4m3fn)
print(json.dumps({
    "swizzle": swizzle_ok,
    "scales": torch.equal(ours[1], theirs[1].view(torch.uint8)),
    "data": torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8)),
}))
"""


def test_layouts_match_the_drops_own_host_helpers():
    """Our swizzle and mxfp8 recipe produce the bytes of the drop's own `to_blocked` and
    `mxfp8_quantize_per_block_32_row` (run in a fresh process: the drop owns top-level names)."""
    from moe_ep_sm100.common.cutedsl import CUTEDSL_DROP

    require_drop(CUTEDSL_DROP)
    assert run_fresh_python(_CROSS_CHECK) == {
        "swizzle": True,
        "scales": True,
        "data": True,
    }


@pytest.mark.gpu
def test_gpu_staging_bytes_equal_cpu_bytes():
    assert_gpu_staging_equals_cpu(stage_mxfp8_inputs, H)

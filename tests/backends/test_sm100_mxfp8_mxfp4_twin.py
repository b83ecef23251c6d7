"""`sm100_mxfp8_mxfp4_bf16_cutedsl`'s host-side quantization against its portable twin
`any_mxfp8_mxfp4_bf16_torch` (`Mxfp8Mxfp4Recipe`), bit for bit: the kernel-ready weights,
with the layout undone, are the twin's stored e2m1 codes and E8M0 scales (and dequantize to
its GEMM operands), and the staged activations are the twin's dispatch payload."""

from __future__ import annotations

import torch

from moe_ep.backends.portable.recipes import Mxfp8Mxfp4Recipe
from moe_ep.quant import deinterleave_gate_up, dequantize_mxfp4, unswizzle_128x4
from moe_ep.types import MoEWeightPack
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.layout import (
    GATE_UP_BLOCK,
    prepare_mxfp4_weights,
    stage_mxfp8_inputs,
)


def _weights(e: int = 2, h: int = 256, i: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w13 = torch.randn(e, 2 * i, h, generator=g) * torch.logspace(-4, 3, h).view(1, 1, h)
    w2 = torch.randn(e, h, i, generator=g)
    w13[0, 1, :32] = 0  # a zero block
    w13[1, 2, 32:64] *= 2.0**-140  # exponents below the normal floor
    return w13.bfloat16(), w2.bfloat16()


def _canonical(codes_kmajor: torch.Tensor, swizzled: torch.Tensor, rows: int, k: int, fc1: bool):
    """Undo the kernel layout: K-major view -> `[E, N, K/2]` codes, swizzled plane ->
    `[E, N, K/32]` scales, FC1 stripes -> gate rows then up rows."""
    codes = codes_kmajor.permute(0, 2, 1).contiguous()
    scales = unswizzle_128x4(swizzled, rows, k // 32)
    if fc1:
        codes, scales = (deinterleave_gate_up(t, GATE_UP_BLOCK) for t in (codes, scales))
    return codes, scales


def test_weights_are_the_twins_codes_and_scales_bit_for_bit() -> None:
    w13, w2 = _weights()
    _, two_i, h = w13.shape
    ours = prepare_mxfp4_weights(w13, w2)
    twin = Mxfp8Mxfp4Recipe().prepare(MoEWeightPack(w13=w13, w2=w2))
    assert twin.stored13 is not None and twin.stored2 is not None
    c13, s13 = _canonical(ours.w13, ours.w13_scales, two_i, h, fc1=True)
    c2, s2 = _canonical(ours.w2, ours.w2_scales, h, two_i // 2, fc1=False)
    assert torch.equal(c13, twin.stored13.codes) and torch.equal(s13, twin.stored13.scales)
    assert torch.equal(c2, twin.stored2.codes) and torch.equal(s2, twin.stored2.scales)
    # and the values the kernel multiplies with are the twin's GEMM operands
    assert torch.equal(dequantize_mxfp4(c13, s13).transpose(1, 2), twin.w13t)
    assert torch.equal(dequantize_mxfp4(c2, s2).transpose(1, 2), twin.w2t)


def test_staged_activations_are_the_twins_dispatch_payload() -> None:
    g = torch.Generator().manual_seed(8)
    x = torch.randn(5, 256, generator=g) * torch.logspace(-3, 3, 256)
    x[0, :32] = 0
    x[3, 64:96] *= 2.0**-135
    x = x.bfloat16()
    ids = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2], [-1, -1]])
    staged = stage_mxfp8_inputs(x, ids, torch.rand(5, 2, generator=g), max_tokens=8)
    payload = Mxfp8Mxfp4Recipe().pack(x)  # [n, H bytes of e4m3 | H/32 E8M0 bytes]
    ours = torch.cat(
        [staged.activation[:5].view(torch.uint8), staged.activation_scales[:5, : 256 // 32]],
        dim=1,
    )
    assert torch.equal(ours, payload)

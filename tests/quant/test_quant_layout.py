"""128x4 swizzle against an independent offset formula; gate/up interleave; K-major views."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_ref import swizzle_offset

import moe_ep.quant as q


@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (128, 4), (130, 7), (300, 9), (7, 130)])
def test_swizzle_matches_the_offset_formula(rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + cols)
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8, generator=g)
    flat = q.swizzle_128x4(s)
    rp, cp = -(-rows // 128) * 128, -(-cols // 4) * 4
    assert flat.shape == (rp * cp,) and flat.is_contiguous()
    assert q.swizzled_128x4_numel(rows, cols) == rp * cp
    want = [0] * (rp * cp)  # padding is zero
    for r, row in enumerate(s.tolist()):
        for c, v in enumerate(row):
            want[swizzle_offset(r, c, cols)] = v
    assert flat.tolist() == want


@settings(max_examples=30, deadline=None)
@given(
    lead=st.sampled_from([(), (3,), (2, 2)]),
    rows=st.integers(1, 300),
    cols=st.integers(1, 40),
    dtype=st.sampled_from([torch.uint8, torch.float8_e8m0fnu, torch.float8_e4m3fn, torch.float32]),
)
def test_swizzle_round_trip_ragged(
    lead: tuple[int, ...], rows: int, cols: int, dtype: torch.dtype
) -> None:
    raw = torch.randint(0, 127, (*lead, rows, cols), dtype=torch.uint8)
    s = raw.view(dtype) if dtype != torch.float32 else raw.float()
    sw = q.swizzle_128x4(s)
    assert sw.dtype == dtype and sw.shape == (*lead, q.swizzled_128x4_numel(rows, cols))
    back = q.unswizzle_128x4(sw, rows, cols)
    assert back.dtype == dtype and back.shape == s.shape
    if dtype == torch.float32:
        assert torch.equal(back, s)
    else:
        assert torch.equal(back.view(torch.uint8), raw)
    # Per-plane: a batch swizzles each plane independently.
    if lead:
        first = s.reshape(-1, rows, cols)[0]
        assert torch.equal(
            sw.reshape(-1, sw.shape[-1])[0].view(torch.uint8),
            q.swizzle_128x4(first).view(torch.uint8),
        )


@pytest.mark.parametrize("block", [8, 16, 32])
def test_interleave_gate_up_order_and_round_trip(block: int) -> None:
    e, i, h = 2, 4 * block, 3
    w13 = torch.arange(e * 2 * i * h).view(e, 2 * i, h)
    out = q.interleave_gate_up(w13, block)
    # Expected row order built by hand: gate block j then up block j.
    order: list[int] = []
    for j in range(i // block):
        order += list(range(j * block, (j + 1) * block))
        order += list(range(i + j * block, i + (j + 1) * block))
    assert torch.equal(out, w13[:, order, :])
    assert torch.equal(q.deinterleave_gate_up(out, block), w13)
    # Along another dim (e.g. a bias [E, 2I]).
    bias = torch.arange(e * 2 * i).view(e, 2 * i)
    assert torch.equal(q.interleave_gate_up(bias, block, dim=-1), bias[:, order])
    assert torch.equal(
        q.deinterleave_gate_up(q.interleave_gate_up(bias, block, dim=-1), block, dim=-1), bias
    )


def test_interleave_applies_to_quantized_planes_consistently() -> None:
    # Interleaving rows commutes with row-wise quantization (data and scales move together).
    w13 = torch.randn(2, 64, 64)
    p, s = q.quantize_mxfp4(w13)
    p2, s2 = q.quantize_mxfp4(q.interleave_gate_up(w13, 16))
    assert torch.equal(q.interleave_gate_up(p, 16), p2)
    assert torch.equal(q.interleave_gate_up(s, 16), s2)


def test_k_major_views() -> None:
    w = torch.randn(2, 6, 8)  # [E, N, K]
    b = q.k_major_view(w)
    assert b.shape == (2, 8, 6) and q.is_k_major(b) and b.data_ptr() == w.data_ptr()
    n_major = torch.randn(8, 6)  # [K, N] row-major: N contiguous
    assert not q.is_k_major(n_major)
    fixed = q.make_k_major(n_major)
    assert q.is_k_major(fixed) and torch.equal(fixed, n_major)
    assert q.make_k_major(b) is b

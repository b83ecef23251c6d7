"""The NVFP4 x FP8 pull kernel's logical weight ABI and staging, on CPU, against references
written here element by element from the layout's definition (`layout` module doc: the K
permutation's formula, the gate/up blocks of 8, the scale-pair trade, the 64 x 128 fold), a
round trip, and staging against the MXFP4 kernel's (the shared wire). The pack's value checks
and the bit-exact comparison with the portable twin are in `test_sm90_nvfp4_kernel.py`."""

from __future__ import annotations

import pytest
import torch

from moe_ep import quant
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import MoEWeightPack
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.layout import stage_mxfp4_hybrid_inputs
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl import layout as L

E, I, H = 2, 128, 256  # noqa: E741 - glossary names
KPERMS = (0, 32, 64)


def _pi(p: int, kperm: int) -> int:
    """Source of position p inside one chunk, bit by bit from the definition."""
    if kperm == 0:
        return p
    j = p & 3
    if kperm == 32:  # p = 16h + 8a + 4b + j -> 16a + 8b + 4h + j
        h, a, b = (p >> 4) & 1, (p >> 3) & 1, (p >> 2) & 1
        return 16 * a + 8 * b + 4 * h + j
    i, h, c = (p >> 5) & 1, (p >> 4) & 1, (p >> 2) & 3  # p = 32i + 16h + 4c + j
    return 16 * c + 8 * i + 4 * h + j


def _src(x: int, kperm: int) -> int:
    return x if kperm == 0 else x - x % kperm + _pi(x % kperm, kperm)


def _fc1_row_source(r: int, kperm: int) -> int:
    """Canonical w13 row that physical row r holds: blocks of 8 alternate gate / up, and
    each half is K-permuted on its own."""
    block, within = divmod(r, 8)
    pair, up = divmod(block, 2)
    return up * I + _src(pair * 8 + within, kperm)


def _expected_leg(
    codes: torch.Tensor, scales: torch.Tensor, kperm: int, fc1: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed payload, folded scale bytes) written out index by index."""
    e, n, k = codes.shape
    rows = [(_fc1_row_source(r, kperm) if fc1 else r) for r in range(n)]
    cols = [_src(c, kperm) for c in range(k)]
    out = torch.empty_like(codes)
    for r in range(n):
        out[:, r] = codes[:, rows[r]][:, cols]
    raw = scales[:, rows]  # scales of a row follow the row; K groups are not permuted
    if kperm:
        swapped = raw.clone()
        for r in range(n):
            q, s, g = r // 16, r // 8 % 2, r % 8
            for t in range(raw.shape[2]):
                pair, u = divmod(t, 2)
                swapped[:, r, t] = raw[:, 16 * q + 8 * u + g, 2 * pair + s]
        raw = swapped
    folded = torch.empty((e, n // 64, raw.shape[2] // 8, 32, 16), dtype=torch.uint8)
    for b in range(n // 64):
        for c in range(raw.shape[2] // 8):
            for m1 in range(4):
                for m0 in range(16):
                    for g1 in range(4):
                        for g0 in range(2):
                            flat = ((4 * m1 + g1) * 16 + m0) * 2 + g0
                            row, col = 64 * b + 16 * m1 + m0, 8 * c + 2 * g1 + g0
                            folded[:, b, c, flat // 16, flat % 16] = raw[:, row, col]
    return quant.pack_e2m1(out.contiguous()), folded


def _pack(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def codes(n: int, k: int) -> torch.Tensor:
        return torch.randint(0, 16, (E, n, k), dtype=torch.uint8, generator=gen)

    def scales(n: int, k: int) -> torch.Tensor:
        return torch.randint(0, 127, (E, n, k // 16), dtype=torch.uint8, generator=gen)

    return dict(
        c13=codes(2 * I, H), s13=scales(2 * I, H), c2=codes(H, I), s2=scales(H, I),
        g13=torch.rand(E, generator=gen) + 0.5, g2=torch.rand(E, generator=gen) + 0.5,
    )  # fmt: skip


@pytest.mark.parametrize("kperm", KPERMS)
def test_legs_match_the_layout_written_out_index_by_index(kperm: int) -> None:
    p = _pack(kperm)
    pack = MoEWeightPack(
        w13=quant.pack_e2m1(p["c13"]), w2=quant.pack_e2m1(p["c2"]),
        w13_scale=p["s13"].view(torch.float8_e4m3fn), w2_scale=p["s2"],
        w13_global_scale=p["g13"], w2_global_scale=p["g2"],
    )  # fmt: skip
    fc1, fc2 = L.prepare_nvfp4_weights(pack, kperm=kperm)
    for leg, codes, scales, g, is_fc1 in (
        (fc1, p["c13"], p["s13"], p["g13"], True),
        (fc2, p["c2"], p["s2"], p["g2"], False),
    ):
        payload, folded = _expected_leg(codes, scales, kperm, is_fc1)
        assert torch.equal(leg.payload, payload)
        assert torch.equal(leg.scales, folded)
        assert leg.scales.shape == (E, codes.shape[1] // 64, codes.shape[2] // 128, 32, 16)
        assert torch.equal(leg.decode_x8, g * 8)


@pytest.mark.parametrize("kperm", KPERMS)
def test_round_trip(kperm: int) -> None:
    p = _pack(10 + kperm)
    w13, w2 = quant.pack_e2m1(p["c13"]), quant.pack_e2m1(p["c2"])
    pack = MoEWeightPack(
        w13=w13, w2=w2, w13_scale=p["s13"], w2_scale=p["s2"], w13_global_scale=p["g13"],
        w2_global_scale=p["g2"],
    )  # fmt: skip
    fc1, fc2 = L.prepare_nvfp4_weights(pack, kperm=kperm)
    cases = ((fc1, w13, p["s13"], p["g13"], True), (fc2, w2, p["s2"], p["g2"], False))
    for leg, w, s, g, is_fc1 in cases:
        back = L.unprepare_nvfp4_leg(leg, kperm=kperm, fc1=is_fc1)
        assert torch.equal(back[0], w) and torch.equal(back[1], s) and torch.equal(back[2], g)


def test_the_permutations_are_bijections_within_their_chunks() -> None:
    for kperm in (32, 64):
        index = L.kperm_index(256, kperm)
        for start in range(0, 256, kperm):
            assert sorted(index[start : start + kperm].tolist()) == list(
                range(start, start + kperm)
            )
        assert not torch.equal(index, torch.arange(256))
        assert index.tolist() == [_src(x, kperm) for x in range(256)]
        # runs of four K values stay together (the kernel moves them as 32-bit words)
        assert torch.equal(
            index.view(-1, 4) - index.view(-1, 4)[:, :1], torch.arange(4).expand(64, 4)
        )
    assert torch.equal(L.swap_scale_pairs(L.swap_scale_pairs(_pack(1)["s13"])), _pack(1)["s13"])


def test_no_global_scale_means_one() -> None:
    p = _pack(3)
    pack = MoEWeightPack(
        w13=quant.pack_e2m1(p["c13"]), w2=quant.pack_e2m1(p["c2"]), w13_scale=p["s13"],
        w2_scale=p["s2"],
    )  # fmt: skip
    fc1, _ = L.prepare_nvfp4_weights(pack, kperm=64)
    assert torch.equal(fc1.decode_x8, torch.full((E,), 8.0))


def test_planes_that_do_not_fit_together_are_refused() -> None:
    p = _pack(4)
    with pytest.raises(MoeEpUsageError, match=r"w13_scale must have shape \(2, 256, 16\)"):
        pack = MoEWeightPack(
            w13=quant.pack_e2m1(p["c13"]), w2=quant.pack_e2m1(p["c2"]),
            w13_scale=p["s13"][:, :, :-1], w2_scale=p["s2"],
        )  # fmt: skip
        L.prepare_nvfp4_weights(pack, kperm=0)


@pytest.mark.parametrize("kperm", KPERMS)
def test_staging_is_the_mxfp4_wire_with_h_in_kperm_order(kperm: int) -> None:
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(5, H, generator=gen) * 3).bfloat16()
    ids = torch.tensor([[0, 1], [2, -1], [3, 0], [1, 2], [-1, -1]])
    w = torch.rand(5, 2, generator=gen)
    got = L.stage_nvfp4_inputs(x, ids, w, max_tokens=8, kperm=kperm)
    base = stage_mxfp4_hybrid_inputs(x, ids, w, max_tokens=8)
    index = L.kperm_index(H, kperm)
    assert torch.equal(
        got.activation.view(torch.uint8)[:5], base.activation.view(torch.uint8)[:5, index]
    )
    assert torch.equal(got.activation.view(torch.uint8)[5:], torch.zeros(3, H, dtype=torch.uint8))
    assert got.activation_scales is not None and base.activation_scales is not None
    assert torch.equal(got.activation_scales, base.activation_scales)  # [T, 4], per token
    assert torch.equal(got.topk_ids, base.topk_ids) and torch.equal(
        got.topk_weights, base.topk_weights
    )
    assert got.num_tokens == 5 and got.activation_scales.shape == (8, 4)

"""`fc1_gate_up_interleave` of the portable fp8 recipe (the sm90 pull kernel's FC1 scale
blocks) at EP 1 and 2 against the oracle with the same option; config/oracle validation."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from layer_cases import Case, from_wire, make_problem

from moe_ep.backends.portable.configs import Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig
from moe_ep.backends.portable.recipes import Fp8BlockRecipe
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.spawn import spawn_local
from moe_ep.types import MoEWeightPack

FMAX = 448.0
PLAIN = Case("fp8_plain", seed=7)
KNOB = Case("fp8_interleave8", seed=7, config=(("fc1_gate_up_interleave", 8),))


@cache
def _run(world_size: int) -> dict[str, torch.Tensor]:
    from layer_cases import cases_worker

    jobs = [(PLAIN, "fp8"), (KNOB, "fp8")]
    results = spawn_local(cases_worker, world_size, jobs, False, timeout_s=240)
    return {
        key: torch.cat([from_wire(r["out"][key]) for r in results]) for key in results[0]["out"]
    }


def _oracle(world_size: int, interleave: int | None):
    p = make_problem(KNOB, world_size)
    return oracle_forward(
        p["x"],
        p["ids"],
        p["topk_weights"],
        p["w13"],
        p["w2"],
        fmt="fp8",
        fc1_gate_up_interleave=interleave,
    )


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", (1, 2))
def test_interleave_knob_matches_the_oracle_with_the_same_knob(world_size: int) -> None:
    got = _run(world_size)
    knob, plain = got[f"{KNOB.name}/fp8"], got[f"{PLAIN.name}/fp8"]
    with_knob, without = _oracle(world_size, 8), _oracle(world_size, None)
    report = compare_to_oracle(knob, with_knob)
    assert report.ok, f"EP{world_size}: {report}"
    assert compare_to_oracle(plain, without).ok
    # The option changes what is computed: different FC1 scale blocks, different outputs.
    assert not torch.equal(with_knob.exact, without.exact)
    assert not torch.equal(knob, plain)


def _qdq(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().max()
    scale = amax / FMAX if amax > 0 else torch.tensor(1.0)
    return (x / scale).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn).float() * scale


def _paired_blocks_reference(w13: torch.Tensor, rows_each: int) -> torch.Tensor:
    """128x128 blocks each pairing gate rows [r*j, r*j+r) with up rows [I+r*j, I+r*j+r),
    r = rows_each = 64 (what interleaving in blocks of 8, 16 or 32 gives)."""
    w = w13.float()
    e, two_i, h = w.shape
    inter = two_i // 2
    out = torch.empty_like(w)
    for ex in range(e):
        for j in range(inter // rows_each):
            g = slice(rows_each * j, rows_each * (j + 1))
            u = slice(inter + rows_each * j, inter + rows_each * (j + 1))
            for c in range(h // 128):
                cols = slice(128 * c, 128 * (c + 1))
                blk = _qdq(torch.cat([w[ex, g, cols], w[ex, u, cols]]))
                out[ex, g, cols], out[ex, u, cols] = blk[:rows_each], blk[rows_each:]
    return out


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w13 = torch.randn(2, 512, 256, generator=g) * 0.05
    w13[:, 256:] *= 3.0  # up rows larger: a gate/up grouping change moves the scales
    w13[:, :128] *= 0.25
    return w13.bfloat16(), (torch.randn(2, 256, 256, generator=g) * 0.05).bfloat16()


@pytest.mark.parametrize("block", [8, 16, 32])
def test_recipe_quantizes_fc1_over_paired_gate_up_rows(block: int) -> None:
    w13, w2 = _weights()
    got = Fp8BlockRecipe(block).prepare(MoEWeightPack(w13=w13, w2=w2))
    plain = Fp8BlockRecipe().prepare(MoEWeightPack(w13=w13, w2=w2))
    assert torch.equal(got.w13t, _paired_blocks_reference(w13, 64).transpose(1, 2))
    assert torch.equal(got.w2t, plain.w2t)  # FC2 untouched
    assert not torch.equal(got.w13t, plain.w13t)


def test_oracle_option_quantizes_fc1_like_the_recipe() -> None:
    w13, w2 = _weights()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 256, generator=g).bfloat16()
    ids = torch.tensor([[0, 1]] * 6)
    wts = torch.rand(6, 2, generator=g)
    got = oracle_forward(x, ids, wts, w13, w2, fmt="fp8", fc1_gate_up_interleave=8)
    plain = oracle_forward(x, ids, wts, w13, w2, fmt="fp8")
    assert not torch.equal(got.exact, plain.exact)
    # Row-wise formats have no block across rows: the option changes nothing there.
    for fmt in ("bf16", "mxfp8"):
        a = oracle_forward(x, ids, wts, w13, w2, fmt=fmt, fc1_gate_up_interleave=16)
        assert torch.equal(a.exact, oracle_forward(x, ids, wts, w13, w2, fmt=fmt).exact)


@pytest.mark.parametrize("bad", [0, 4, 12, 64, True, 8.0, "8"])
def test_bad_interleave_is_rejected(bad: Any) -> None:
    with pytest.raises(MoeEpUsageError, match="fc1_gate_up_interleave"):
        Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig(fc1_gate_up_interleave=bad)
    x, ids, wts = (
        torch.zeros(1, 128).bfloat16(),
        torch.zeros(1, 1, dtype=torch.long),
        torch.ones(1, 1),
    )
    w13, w2 = torch.zeros(1, 256, 128), torch.zeros(1, 128, 128)
    with pytest.raises(MoeEpUsageError, match="fc1_gate_up_interleave"):
        oracle_forward(x, ids, wts, w13, w2, fmt="fp8", fc1_gate_up_interleave=bad)


@pytest.mark.parametrize("good", [None, 8, 16, 32])
def test_good_interleave_is_accepted(good: int | None) -> None:
    assert (
        Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig(fc1_gate_up_interleave=good).fc1_gate_up_interleave
        == good
    )


def test_prequantized_pack_is_rejected_with_the_knob() -> None:
    from moe_ep.quant import quantize_fp8_blockwise

    w13, w2 = _weights()
    q13, s13 = quantize_fp8_blockwise(w13, block=(128, 128))
    q2, s2 = quantize_fp8_blockwise(w2, block=(128, 128))
    pack = MoEWeightPack(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)
    Fp8BlockRecipe().check_scales(pack)
    with pytest.raises(MoeEpUsageError, match=r"fc1_gate_up_interleave=8.*pre-quantized"):
        Fp8BlockRecipe(8).check_scales(pack)

"""Kernel-ready fp8 weights and staged inputs of the sm90 kernels, checked on CPU.

Expectations are computed independently of the kernels' `layout` modules: block amaxes and index
maps are written out here with plain loops / reshapes, and the push kernel (same recipe as the
portable backend) must dequantize to exactly the portable backend's weights; the pull kernel
to exactly the portable backend's with `fc1_gate_up_interleave=8`.
"""

from __future__ import annotations

import pytest
import torch
from backend_testing import require_drop, run_fresh_python
from layout_references import dequantize_pull_weights, dequantize_push_weights

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.config import PULL_GATE_UP_BLOCK
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.layout import (
    prepare_pull_weights,
    stage_pull_inputs,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.layout import (
    prepare_push_weights,
    stage_push_inputs,
)

E, I, H = 2, 256, 384  # noqa: E741 - the glossary names (I = intermediate)
FMAX = 448.0


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    # Distinct magnitudes per row group, so a wrong block grouping changes the scales.
    w13[:, I:] *= 3.0
    w13[:, : I // 2] *= 0.25
    return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


def _qdq(x: torch.Tensor) -> torch.Tensor:
    """Reference quantize-dequantize of one block with its own amax (fp32 math, RNE cast)."""
    amax = x.abs().max()
    scale = amax / FMAX if amax > 0 else torch.tensor(1.0)
    return (x / scale).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn).float() * scale


def _pull_fc1_reference(w13: torch.Tensor) -> torch.Tensor:
    """What the pull kernel computes with: 128-row blocks over gate/up interleaved rows,
    i.e. block j pairs gate rows [64j, 64j+64) with up rows [64j, 64j+64)."""
    w = w13.float()
    out = torch.empty_like(w)
    for e in range(E):
        for j in range(I // 64):
            rows_g = slice(64 * j, 64 * j + 64)
            rows_u = slice(I + 64 * j, I + 64 * j + 64)
            for c in range(H // 128):
                cols = slice(128 * c, 128 * c + 128)
                block = torch.cat([w[e, rows_g, cols], w[e, rows_u, cols]])
                got = _qdq(block)
                out[e, rows_g, cols] = got[:64]
                out[e, rows_u, cols] = got[64:]
    return out


def _canonical_reference(w: torch.Tensor) -> torch.Tensor:
    """Plain 128x128 blocks on the stored row order (the portable fp8 recipe)."""
    w = w.float()
    out = torch.empty_like(w)
    for e in range(w.shape[0]):
        for r in range(w.shape[1] // 128):
            for c in range(w.shape[2] // 128):
                blk = (e, slice(128 * r, 128 * r + 128), slice(128 * c, 128 * c + 128))
                out[blk] = _qdq(w[blk])
    return out


def test_pull_weights_are_k_major_views_of_interleaved_rows():
    w13, w2 = _weights()
    p = prepare_pull_weights(w13, w2)
    assert p.w13.shape == (E, H, 2 * I) and p.w13.stride(1) == 1
    assert p.w2.shape == (E, I, H) and p.w2.stride(1) == 1
    assert p.w13.dtype == p.w2.dtype == torch.float8_e4m3fn
    assert p.w13_scales.shape == (E, 2 * I // 128, H // 128)
    assert p.w2_scales.shape == (E, H // 128, I // 128)
    # Kernel column n of FC1 is gate row (n//16)*8 + n%8 for n%16 < 8, else that up row.
    stored = p.w13.permute(0, 2, 1)  # [E, 2I, H], the kernel's N order
    for n in (0, 7, 8, 15, 16, 2 * I - 1):
        pair, lane = divmod(n, 2 * PULL_GATE_UP_BLOCK)
        row = pair * PULL_GATE_UP_BLOCK + lane % PULL_GATE_UP_BLOCK
        row += I if lane >= PULL_GATE_UP_BLOCK else 0
        scale_row = n // 128
        expect = (
            (w13[:, row].float() / p.w13_scales[:, scale_row].repeat_interleave(128, -1))
            .clamp(-FMAX, FMAX)
            .to(torch.float8_e4m3fn)
        )
        assert torch.equal(stored[:, n].view(torch.uint8), expect.view(torch.uint8)), n


def test_pull_weights_dequantize_to_the_kernel_block_grouping():
    w13, w2 = _weights(1)
    got13, got2 = dequantize_pull_weights(prepare_pull_weights(w13, w2))
    assert torch.equal(got13, _pull_fc1_reference(w13))
    assert torch.equal(got2, _canonical_reference(w2))


def test_pull_fc1_grouping_differs_from_the_canonical_recipe():
    # Documented: the pull kernel's FC1 scale blocks are not the DEFAULT portable recipe's
    # (they are its `fc1_gate_up_interleave=8` variant's, see the exact test below).
    w13, w2 = _weights(2)
    got13, _ = dequantize_pull_weights(prepare_pull_weights(w13, w2))
    assert not torch.equal(got13, _canonical_reference(w13))


def test_pull_weights_dequantize_exactly_to_the_portable_backend_with_interleave_8():
    from moe_ep.backends.portable.configs import Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig
    from moe_ep.backends.portable.kernel import Fp8TorchKernel
    from moe_ep.types import MoEWeightPack

    w13, w2 = _weights(2)
    got13, got2 = dequantize_pull_weights(prepare_pull_weights(w13, w2))
    cfg = Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig(fc1_gate_up_interleave=PULL_GATE_UP_BLOCK)
    portable = Fp8TorchKernel.make_recipe(cfg).prepare(MoEWeightPack(w13=w13, w2=w2))
    assert torch.equal(got13.transpose(1, 2), portable.w13t)
    assert torch.equal(got2.transpose(1, 2), portable.w2t)


def test_push_weights_dequantize_exactly_to_the_portable_backend():
    from moe_ep.backends.portable.recipes import Fp8BlockRecipe
    from moe_ep.types import MoEWeightPack

    w13, w2 = _weights(3)
    p = prepare_push_weights(w13, w2)
    assert p.w13.shape == (E, 2 * I, H) and p.w13.is_contiguous()
    assert p.w2.shape == (E, H, I) and p.w2.is_contiguous()
    got13, got2 = dequantize_push_weights(p)
    assert torch.equal(got13, _canonical_reference(w13))
    assert torch.equal(got2, _canonical_reference(w2))
    portable = Fp8BlockRecipe().prepare(MoEWeightPack(w13=w13, w2=w2))
    assert torch.equal(got13.transpose(1, 2), portable.w13t)
    assert torch.equal(got2.transpose(1, 2), portable.w2t)


def _sm90_kernels() -> list[tuple[type, object]]:
    from moe_ep_sm90 import (
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
        Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig,
        Sm90Fp8Fp8Bf16PullCutedslKernel,
        Sm90Fp8Fp8Bf16PushCudaKernel,
    )

    return [
        (Sm90Fp8Fp8Bf16PullCutedslKernel, Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig()),
        (Sm90Fp8Fp8Bf16PushCudaKernel, Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig()),
    ]


@pytest.mark.parametrize(
    ("w13_shape", "w2_shape", "match"),
    [
        ((E, 2 * I, H), (E, H, I + 128), "w13 must be"),
        ((E, 2 * I, 100), (E, 100, I), "H must be a multiple of 128"),
        ((E, 2 * 64, H), (E, H, 64), "I must be a multiple of 128"),
    ],
)
def test_weight_shapes_are_validated(w13_shape, w2_shape, match):
    """The pack's shapes are checked once, by the kernels' `validate_weights`."""
    from moe_ep.types import FleetParams, MoEWeightPack

    hidden = w13_shape[2]
    fleet = FleetParams(num_experts=E, max_tokens_per_rank=64, hidden_size=hidden)
    pack = MoEWeightPack(w13=torch.zeros(w13_shape), w2=torch.zeros(w2_shape))
    for kernel, cfg in _sm90_kernels():
        with pytest.raises(MoeEpUsageError, match=match):
            kernel.validate_weights(pack, fleet, 1, cfg)


def test_quantized_weights_need_their_scales():
    """An fp8 payload without scale planes is refused (bf16 / fp32 unquantized only)."""
    from moe_ep.types import FleetParams, MoEWeightPack

    w = torch.zeros(E, 2 * I, H, dtype=torch.float8_e4m3fn)
    fleet = FleetParams(num_experts=E, max_tokens_per_rank=64, hidden_size=H)
    for kernel, cfg in _sm90_kernels():
        with pytest.raises(MoeEpUsageError, match=r"one of \(bfloat16, float32\)"):
            kernel.validate_weights(MoEWeightPack(w13=w, w2=torch.zeros(E, H, I)), fleet, 1, cfg)


def _inputs(n: int, k: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, H, generator=g) * 2).to(torch.bfloat16)
    ids = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int64)
    if n:
        ids[0, 1] = -1
        ids[n - 1, :] = -1
    w = torch.rand(n, k, generator=g)
    return x, ids, w


def test_pull_staging_bytes():
    n, t = 5, 8
    x, ids, w = _inputs(n)
    s = stage_pull_inputs(x, ids.to(torch.int32), w, max_tokens=t)
    assert s.num_tokens == n
    assert s.activation.shape == (t, H) and s.activation.dtype == torch.float8_e4m3fn
    cols = H // 128
    assert s.activation_scales.shape == (t, 4)  # 3 scale columns padded to 4 (16-byte rows)
    for r in range(n):
        for c in range(cols):
            blk = x[r, 128 * c : 128 * c + 128].float()
            scale = blk.abs().max() / FMAX
            assert s.activation_scales[r, c] == scale
            expect = (blk / scale).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn)
            got = s.activation[r, 128 * c : 128 * c + 128]
            assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))
    assert torch.all(s.activation_scales[:, cols:] == 0)
    assert torch.all(s.activation[n:].view(torch.uint8) == 0)
    assert torch.all(s.activation_scales[n:] == 0)
    assert s.topk_ids.dtype == torch.int64
    assert torch.equal(s.topk_ids[:n], ids)
    assert torch.all(s.topk_ids[n:] == -1)
    assert torch.equal(s.topk_weights[:n], torch.where(ids >= 0, w, 0.0))
    assert torch.all(s.topk_weights[n:] == 0)


def test_push_staging_bytes():
    n, t = 3, 6
    x, ids, w = _inputs(n, k=8, seed=1)
    s = stage_push_inputs(x, ids, w, max_tokens=t)
    assert s.activation_scales is None
    assert s.activation.dtype == torch.bfloat16 and torch.equal(s.activation[:n], x)
    assert torch.all(s.activation[n:] == 0)
    assert s.topk_ids.dtype == torch.int32
    assert torch.equal(s.topk_ids[:n], ids.to(torch.int32))
    assert torch.all(s.topk_ids[n:] == -1)
    assert torch.equal(s.topk_weights[:n], torch.where(ids >= 0, w, 0.0))


@pytest.mark.parametrize("stage", [stage_pull_inputs, stage_push_inputs])
def test_staging_zero_tokens(stage):
    x, ids, w = _inputs(0)
    s = stage(x, ids, w, max_tokens=4)
    assert s.num_tokens == 0
    assert torch.all(s.topk_ids == -1) and torch.all(s.topk_weights == 0)


@pytest.mark.parametrize("stage", [stage_pull_inputs, stage_push_inputs])
def test_staging_rejects_too_many_tokens_and_bad_shapes(stage):
    x, ids, w = _inputs(5)
    with pytest.raises(MoeEpUsageError, match="max_tokens=4"):
        stage(x, ids, w, max_tokens=4)
    with pytest.raises(MoeEpUsageError, match="topk_weights"):
        stage(x, ids, w[:, :2], max_tokens=8)


def test_kernels_validate_packs_before_any_collective():
    from moe_ep.types import FleetParams, MoEWeightPack

    w13, w2 = _weights()
    fleet = FleetParams(num_experts=2 * E, max_tokens_per_rank=64, hidden_size=H)
    for kernel, cfg in _sm90_kernels():
        kernel.validate_weights(MoEWeightPack(w13=w13, w2=w2), fleet, 2, cfg)
        with pytest.raises(MoeEpUsageError, match="= 4 / 4 = 1 experts"):
            kernel.validate_weights(MoEWeightPack(w13=w13, w2=w2), fleet, 4, cfg)
        q13, s13 = torch.zeros_like(w13, dtype=torch.float8_e4m3fn), torch.ones(E, 4, 3)
        q2, s2 = torch.zeros_like(w2, dtype=torch.float8_e4m3fn), torch.ones(E, 3, 2)
        # pre-quantized packs are taken when they fit the recipe (test_sm90_fp8_packs.py)
        packed = MoEWeightPack(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)
        kernel.validate_weights(packed, fleet, 2, cfg)
        packed = MoEWeightPack(w13=q13, w2=q2, w13_scale=s13[:, :2], w2_scale=s2)
        with pytest.raises(MoeEpUsageError, match="one scale per 128x128 block"):
            kernel.validate_weights(packed, fleet, 2, cfg)


_CROSS_CHECK = r"""
import json, torch
import moe_ep_drop_sm90_pull as drop
from moe_ep.quant import quantize_fp8_blockwise
hu = drop.import_src_module("moe_hopper_fp8.hopper_moe_utils")
g = torch.Generator().manual_seed(0)
x = torch.randn(32, 512, generator=g) * torch.logspace(-3, 3, 32).unsqueeze(1)
w = torch.randn(256, 384, generator=g) * 0.02
qa, sa = quantize_fp8_blockwise(x, block=(1, 128))
ra, rsa = hu.quantize_fp8_per_token_block(x, torch.float8_e4m3fn)
qw, sw = quantize_fp8_blockwise(w, block=(128, 128))
rw, rsw = hu.quantize_fp8_weight_block_nk(w, torch.float8_e4m3fn)
print(json.dumps({
    "act": torch.equal(qa.view(torch.uint8), ra.view(torch.uint8)) and torch.equal(sa, rsa),
    "weight": torch.equal(qw.view(torch.uint8), rw.view(torch.uint8)) and torch.equal(sw, rsw),
}))
"""


def test_recipe_matches_the_pull_drops_own_host_quantizers():
    """Our fp8 blockwise bytes equal the drop's `quantize_fp8_per_token_block` /
    `quantize_fp8_weight_block_nk` (nonzero blocks; fresh process: the drop owns top-level
    module names)."""
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.upstream import PULL_DROP

    require_drop(PULL_DROP)
    assert run_fresh_python(_CROSS_CHECK) == {"act": True, "weight": True}

"""Kernel-ready nvfp4 weights and staged inputs of the sm100 nvfp4 kernel, on CPU.

The kernel's weights and alphas must equal the portable `any_nvfp4_nvfp4_bf16_torch`
backend's exactly; the gate/up interleave (16) is checked with an index formula written out
here; staging bytes against a scalar e2m1 / e4m3 reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from backend_hw import require_capability_at_least
from backend_testing import assert_gpu_staging_equals_cpu, require_drop, run_fresh_python
from layout_references import dequantize_nvfp4_weights

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.layout import (
    prepare_nvfp4_weights,
    stage_nvfp4_inputs,
)

E, I, H = 2, 160, 256  # noqa: E741 - the glossary names (I = intermediate)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.05).to(torch.bfloat16)
    w13[1] *= 10.0  # distinct per-expert global scales
    return w13, w2


def test_weights_and_alphas_equal_the_portable_recipe():
    from moe_ep.backends.portable.recipes import Nvfp4Recipe
    from moe_ep.types import MoEWeightPack

    w13, w2 = _weights()
    p = prepare_nvfp4_weights(w13, w2, input_norm_const=3.0, hidden_norm_const=5.0)
    assert p.w13.shape == (E, H // 2, 2 * I) and p.w13.stride(1) == 1
    assert p.w2.shape == (E, I // 2, H) and p.w2.stride(1) == 1
    assert p.w13_scales.shape == (E, 384 * 16) and p.w13_scales.dtype == torch.float8_e4m3fn
    got13, got2 = dequantize_nvfp4_weights(p)
    ref = Nvfp4Recipe(act_global_scale=3.0, hidden_global_scale=5.0).prepare(
        MoEWeightPack(w13=w13, w2=w2)
    )
    assert torch.equal(got13.transpose(1, 2), ref.w13t)
    assert torch.equal(got2.transpose(1, 2), ref.w2t)
    assert torch.equal(p.fc1_alpha, ref.alpha13)
    assert torch.equal(p.fc2_alpha, ref.alpha2)
    assert torch.equal(p.fc1_norm_const, torch.full((E,), 5.0))
    assert p.fc1_alpha[0] != p.fc1_alpha[1]


def test_fc1_rows_are_interleaved_by_16():
    w13, w2 = _weights(1)
    p = prepare_nvfp4_weights(w13, w2)
    rows = p.w13.permute(0, 2, 1)  # [E, 2I, H/2] bytes, kernel row order
    from moe_ep.quant import nvfp4_global_scale, quantize_nvfp4

    canon, _ = quantize_nvfp4(w13, norm_const=nvfp4_global_scale(w13, dim=(-2, -1)))
    for n in (0, 15, 16, 31, 32, 2 * I - 1):
        pair, lane = divmod(n, 32)
        row = pair * 16 + lane % 16 + (I if lane >= 16 else 0)
        assert torch.equal(rows[:, n], canon[:, row]), n


def test_prequantized_pack_keeps_its_bytes():
    from moe_ep.quant import quantize_nvfp4

    w13, w2 = _weights(2)
    q13, s13 = quantize_nvfp4(w13)
    q2, s2 = quantize_nvfp4(w2)
    p = prepare_nvfp4_weights(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)
    got13, _ = dequantize_nvfp4_weights(p)
    from moe_ep.quant import dequantize_nvfp4

    assert torch.equal(got13, dequantize_nvfp4(q13, s13))
    assert torch.equal(p.fc1_alpha, torch.ones(E))
    with pytest.raises(MoeEpUsageError, match="w13_scale"):
        prepare_nvfp4_weights(w13=q13, w2=q2, w13_scale=s13[..., :-1], w2_scale=s2)


def _e2m1_code(v: float) -> int:
    """Round-to-nearest-even onto the e2m1 grid (ties to the even code), sign in bit 3."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - mag), c % 2))
    return best | (8 if v < 0 and best else 0)


def test_staging_bytes():
    g = torch.Generator().manual_seed(3)
    n, t, k, nc = 2, 4, 3, 2.0
    x = (torch.randn(n, H, generator=g)).to(torch.bfloat16)
    ids = torch.tensor([[0, -1, 5], [7, 7, 1]], dtype=torch.int32)
    w = torch.rand(n, k, generator=g)
    s = stage_nvfp4_inputs(x, ids, w, max_tokens=t, input_norm_const=nc)
    assert s.activation.shape == (t, H // 2) and s.activation.dtype == torch.uint8
    assert s.activation_scales.shape == (t, 16)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731 - one fp32 rounding
    for r in range(n):
        for b in (0, 7, H // 16 - 1):
            blk = x[r, 16 * b : 16 * b + 16].float()
            # The drop's rule, each step in fp32: e4m3(amax * fp32(1/6) * nc), then the codes
            # of v * (nc * (1 / scale)).
            scale = (blk.abs().max() * f32(1 / 6) * nc).to(torch.float8_e4m3fn)
            assert s.activation_scales[r, b].view(torch.uint8) == scale.view(torch.uint8)
            acc = f32(nc) * torch.reciprocal(scale.float())
            for j in (0, 1, 14, 15):  # element 2i in the low nibble of byte i
                code = _e2m1_code(float(blk[j] * acc))
                byte = int(s.activation[r, 8 * b + j // 2])
                assert (byte >> (4 * (j % 2))) & 0xF == code, (r, b, j)
    assert torch.all(s.activation[n:] == 0)
    assert torch.equal(s.topk_ids[:n], ids.long()) and torch.all(s.topk_ids[n:] == -1)
    assert s.topk_weights[0, 1] == 0 and torch.all(s.topk_weights[n:] == 0)


_HERE = Path(__file__).resolve().parent

_CPU_CROSS_CHECK = r"""
import json, sys, torch
sys.path.insert(0, HERE)
import moe_ep_drop_sm100_cutedsl as drop
from drop_references import install_cpu_standins
from moe_ep.quant import nvfp4_global_scale, quantize_nvfp4
install_cpu_standins(drop)
rc = drop.import_src_module("moe_nvfp4_swapab.runner_common")
g = torch.Generator().manual_seed(0)
w = (torch.randn(2, 256, 384, generator=g) * 0.05).to(torch.bfloat16)
w[0, :3] = 0.0
w[0, 1, ::3] = -0.0  # zero blocks, +0 and -0
nc = nvfp4_global_scale(w, dim=(-2, -1))  # per expert, as the weights are prepared
res = {"norm_consts": nc.flatten().tolist(), "scales": True, "differing_codes": 0, "codes": 0}
for e in range(2):
    ours_p, ours_s = quantize_nvfp4(w[e], norm_const=nc[e])
    theirs_p, theirs_s = rc.nvfp4_quantize_per_block_16(w[e].float(), float(nc[e]))
    theirs_p = theirs_p.view(torch.uint8)
    res["scales"] &= torch.equal(ours_s.view(torch.uint8), theirs_s.view(torch.uint8))
    res["differing_codes"] += int(((ours_p ^ theirs_p) & 0x0F != 0).sum())
    res["differing_codes"] += int(((ours_p ^ theirs_p) >> 4 != 0).sum())
    res["codes"] += 2 * ours_p.numel()
print(json.dumps(res))
"""


def test_recipe_is_bit_exact_with_the_drops_own_nvfp4_quantizer_on_cpu():
    """Scales and payload codes equal the drop's `nvfp4_quantize_per_block_16` on bf16
    weights with per-expert global scales (not 1), zero blocks included. The drop's function
    runs on CPU with CPU stand-ins for its two CUDA helpers (`drop_references`: an IEEE
    reciprocal for `rcp.approx.ftz`, a nearest-even e2m1 packer for the `cvt`); the rest of
    it (scale rule, `acc = nc * rcp(scale)`, `v * acc`) is the drop's own code. The double
    rounding `fl(fl(v * nc) / scale)` this recipe had got 127 of these 196,608 codes wrong,
    and its block amax gave 64 of the zero blocks scale byte 0x80 (-0)."""
    from moe_ep_sm100.common.cutedsl import CUTEDSL_DROP

    require_drop(CUTEDSL_DROP)
    res = run_fresh_python(_CPU_CROSS_CHECK.replace("HERE", repr(str(_HERE))))
    assert all(v != 1.0 for v in res["norm_consts"]), res
    assert res["scales"] is True and res["codes"] == 196_608
    assert res["differing_codes"] == 0, res


_GPU_CROSS_CHECK = r"""
import json, torch
import moe_ep_drop_sm100_cutedsl as drop
from moe_ep.quant import nvfp4_global_scale, quantize_nvfp4
rc = drop.import_src_module("moe_nvfp4_swapab.runner_common")
g = torch.Generator().manual_seed(0)
x = torch.randn(32, 256, generator=g) * torch.logspace(-2, 2, 32).unsqueeze(1)
w = (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16).float()
out = {"scales": True, "data_mismatch_bytes": 0, "bytes": 0}
for t, nc in ((x, 3.0), (w, float(nvfp4_global_scale(w)))):
    ours_p, ours_s = quantize_nvfp4(t, norm_const=nc)
    theirs_p, theirs_s = rc.nvfp4_quantize_per_block_16(t.cuda(), nc)
    theirs_p, theirs_s = theirs_p.view(torch.uint8).cpu(), theirs_s.cpu()
    out["scales"] &= torch.equal(ours_s.view(torch.uint8), theirs_s.view(torch.uint8))
    out["data_mismatch_bytes"] += int((ours_p != theirs_p).sum())
    out["bytes"] += ours_p.numel()
print(json.dumps(out))
"""


@pytest.mark.gpu
def test_recipe_matches_the_drops_own_nvfp4_quantizer():
    """On a Blackwell GPU: bytes equal the drop's `nvfp4_quantize_per_block_16` with its real
    CUDA helpers (fresh process: the drop owns top-level names). Never run."""
    from moe_ep_sm100.common.cutedsl import CUTEDSL_DROP

    # Its fp4 packer is a Triton kernel around `cvt.rn.satfinite.e2m1x2.f32`, which ptxas
    # accepts only for Blackwell targets: on the H200 of the GPU check it cannot compile.
    require_capability_at_least(
        (10, 0), "the drop's nvfp4 quantizer runs only on a Blackwell GPU (e2m1x2 cvt)"
    )
    require_drop(CUTEDSL_DROP)
    res = run_fresh_python(_GPU_CROSS_CHECK)
    assert res["scales"] is True
    assert res["data_mismatch_bytes"] == 0, res


_RCP_CHECK = r"""
import json, torch
import moe_ep_drop_sm100_cutedsl as drop
rc = drop.import_src_module("moe_nvfp4_swapab.runner_common")
sf = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
got = rc._rcp_approx_ftz_f32_cuda(sf.cuda()).cpu()
print(json.dumps({"differ": sf[got != torch.reciprocal(sf)].tolist(), "n": sf.numel()}))
"""


@pytest.mark.gpu
def test_the_kernels_approximate_reciprocal_is_exact_on_e4m3_scales():
    """The kernels' nvfp4 quantizers multiply by `nc * rcp.approx.ftz(scale)`; our recipe
    (and the CPU stand-in) uses the IEEE reciprocal. Scales are e4m3 values, so the two agree
    on every input that matters iff they agree on all 126 positive finite e4m3 values. Runs on
    any CUDA GPU with Triton (the drop's `_rcp_approx_ftz_f32_cuda`); never run yet."""
    import importlib.util

    from moe_ep_sm100.common.cutedsl import CUTEDSL_DROP

    require_capability_at_least((7, 0), "rcp.approx.ftz.f32 through the drop's Triton helper")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (the drop's rcp helper is a Triton kernel)")
    require_drop(CUTEDSL_DROP)
    res = run_fresh_python(_RCP_CHECK)
    assert res["n"] == 126 and res["differ"] == [], res


@pytest.mark.gpu
def test_gpu_staging_bytes_equal_cpu_bytes():
    assert_gpu_staging_equals_cpu(stage_nvfp4_inputs, H, input_norm_const=2.0)

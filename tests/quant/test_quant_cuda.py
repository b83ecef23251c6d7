"""CUDA tensors give the same bytes as CPU tensors (runs only where a GPU is present)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import moe_ep.quant as q

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES: dict[str, Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "fp8_per_tensor": q.quantize_fp8_per_tensor,
    "fp8_per_row": q.quantize_fp8_per_row,
    "fp8_blockwise": q.quantize_fp8_blockwise,
    "fp8_blockwise_ue8m0": lambda x: q.quantize_fp8_blockwise(x, scale_format="ue8m0"),
    "fp8_blockwise_128": lambda x: q.quantize_fp8_blockwise(x, block=(128, 128)),
    "mxfp8_ceil": q.quantize_mxfp8,
    "mxfp8_ocp_e5m2": lambda x: q.quantize_mxfp8(x, dtype=torch.float8_e5m2, rule="ocp"),
    "mxfp4": q.quantize_mxfp4,
    "nvfp4": lambda x: q.quantize_nvfp4(x, norm_const=q.nvfp4_global_scale(x)),
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8) if t.element_size() == 1 else t.cpu()


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_matches_cpu_bit_exactly(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 200, 256, generator=g) * torch.logspace(-30, 30, 256)
    x[0, :5] = 0.0
    x[1, 7, ::16] = 1e30
    x = x.bfloat16()
    d_cpu, s_cpu = CASES[name](x)
    d_gpu, s_gpu = CASES[name](x.cuda())
    assert d_gpu.is_cuda and s_gpu.is_cuda
    assert torch.equal(_bytes(d_gpu), _bytes(d_cpu))
    assert torch.equal(_bytes(s_gpu), _bytes(s_cpu))


def test_cuda_layouts_match_cpu() -> None:
    s = torch.randint(0, 255, (2, 300, 9), dtype=torch.uint8)
    sw = q.swizzle_128x4(s.cuda())
    assert torch.equal(sw.cpu(), q.swizzle_128x4(s))
    assert torch.equal(q.unswizzle_128x4(sw, 300, 9).cpu(), s)
    w = torch.randn(2, 64, 32)
    assert torch.equal(q.interleave_gate_up(w.cuda(), 16).cpu(), q.interleave_gate_up(w, 16))

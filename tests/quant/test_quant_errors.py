"""Bad input raises MoeEpUsageError (a ValueError) naming the argument and the rule."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

import moe_ep.quant as q
from moe_ep.errors import MoeEpUsageError

QUANTIZERS: dict[str, Callable[..., object]] = {
    "fp8_per_tensor": q.quantize_fp8_per_tensor,
    "fp8_per_row": q.quantize_fp8_per_row,
    "fp8_blockwise": q.quantize_fp8_blockwise,
    "fp8_blockwise_128": lambda x, **kw: q.quantize_fp8_blockwise(x, block=(128, 128), **kw),
    "mxfp8": q.quantize_mxfp8,
    "mxfp4": q.quantize_mxfp4,
    "nvfp4": q.quantize_nvfp4,
}


def test_usage_error_is_a_value_error() -> None:
    assert issubclass(MoeEpUsageError, ValueError)


@pytest.mark.parametrize(
    ("name", "k", "block"),
    [("fp8_blockwise", 130, 128), ("mxfp8", 48, 32), ("mxfp4", 40, 32), ("nvfp4", 24, 16)],
)
def test_k_not_divisible_by_block(name: str, k: int, block: int) -> None:
    with pytest.raises(MoeEpUsageError, match=rf"x\.shape\[-1\].*divisible.*{block}.*K={k}"):
        QUANTIZERS[name](torch.zeros(2, k))


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_rejected(name: str, bad: float) -> None:
    x = torch.randn(2, 128, 128 * 2)
    x[1, 5, 77] = bad
    with pytest.raises(MoeEpUsageError, match="x contains NaN or inf"):
        QUANTIZERS[name](x)
    # Opting out skips the check (documented: output is then unspecified, not an error).
    QUANTIZERS[name](x, check_finite=False)


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.float8_e4m3fn])
def test_wrong_input_dtype(name: str, dtype: torch.dtype) -> None:
    x = torch.zeros(128, 256).to(dtype)
    with pytest.raises(MoeEpUsageError, match=r"x must be float32, bfloat16 or float16"):
        QUANTIZERS[name](x)


def test_bad_options() -> None:
    x = torch.zeros(4, 128)
    with pytest.raises(MoeEpUsageError, match=re.escape("dtype must be torch.float8_e4m3fn or")):
        q.quantize_mxfp8(x, dtype=torch.bfloat16)
    with pytest.raises(MoeEpUsageError, match=r"rule must be one of \('ceil', 'ocp'\)"):
        q.quantize_mxfp8(x, rule="floor")
    with pytest.raises(MoeEpUsageError, match="rule must be one of"):
        q.quantize_mxfp4(x, rule="OCP")
    with pytest.raises(MoeEpUsageError, match="scale_format must be one of"):
        q.quantize_fp8_blockwise(x, scale_format="e8m0")
    with pytest.raises(MoeEpUsageError, match="block must be a pair of positive ints"):
        q.quantize_fp8_blockwise(x, block=(0, 128))
    with pytest.raises(MoeEpUsageError, match="scale_dtype must be"):
        q.quantize_mxfp8(x, scale_dtype=torch.float32)
    with pytest.raises(MoeEpUsageError, match="norm_const must be a positive finite float"):
        q.quantize_nvfp4(x, norm_const=0.0)
    with pytest.raises(MoeEpUsageError, match="does not broadcast"):
        q.quantize_nvfp4(x, norm_const=torch.ones(3, 1))
    with pytest.raises(MoeEpUsageError, match="norm_const must have dtype"):
        q.quantize_nvfp4(x, norm_const=torch.ones(4, 1, dtype=torch.float64))
    with pytest.raises(MoeEpUsageError, match=r"x must be \[\.\.\., N, K\]"):
        q.quantize_fp8_blockwise(torch.zeros(128), block=(128, 128))


def test_dequantize_checks() -> None:
    p, s = q.quantize_nvfp4(torch.randn(4, 64))
    with pytest.raises(MoeEpUsageError, match="packed must be contiguous"):
        q.dequantize_nvfp4(p.t().contiguous().t(), s)
    with pytest.raises(MoeEpUsageError, match=re.escape("packed must have dtype torch.uint8")):
        q.dequantize_nvfp4(p.to(torch.int32), s)
    with pytest.raises(MoeEpUsageError, match=r"scales must have shape \(4, 4\)"):
        q.dequantize_nvfp4(p, s[:, :2])
    msg = "scales must have dtype torch.float8_e4m3fn"
    with pytest.raises(MoeEpUsageError, match=re.escape(msg)):
        q.dequantize_nvfp4(p, s.float())
    pm, sm = q.quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(MoeEpUsageError, match="packed must be contiguous"):
        q.dequantize_mxfp4(pm.t().contiguous().t(), sm)
    msg = "scales must be uint8 or torch.float8_e8m0fnu"
    with pytest.raises(MoeEpUsageError, match=re.escape(msg)):
        q.dequantize_mxfp4(pm, sm.float())
    d, sd = q.quantize_mxfp8(torch.randn(4, 64))
    with pytest.raises(MoeEpUsageError, match="data must have dtype"):
        q.dequantize_mxfp8(d.float(), sd)
    db, sb = q.quantize_fp8_blockwise(torch.randn(256, 256), block=(128, 128))
    with pytest.raises(MoeEpUsageError, match=r"scales must have shape \(2, 2\)"):
        q.dequantize_fp8_blockwise(db, sb[:1], block=(128, 128))
    with pytest.raises(MoeEpUsageError, match="powers of two"):
        q.float32_pow2_to_e8m0(torch.tensor([3.0]))


def test_layout_checks() -> None:
    with pytest.raises(MoeEpUsageError, match=r"scales must be \[\.\.\., rows, cols\]"):
        q.swizzle_128x4(torch.zeros(5, dtype=torch.uint8))
    with pytest.raises(MoeEpUsageError, match=r"swizzled must be \[\.\.\., 512\]"):
        q.unswizzle_128x4(torch.zeros(100, dtype=torch.uint8), 3, 3)
    with pytest.raises(MoeEpUsageError, match=r"block must be one of \(8, 16, 32\)"):
        q.interleave_gate_up(torch.zeros(64, 4), 12)
    with pytest.raises(MoeEpUsageError, match=r"must be a multiple of 2 \* block = 32"):
        q.interleave_gate_up(torch.zeros(48, 4), 16)
    with pytest.raises(MoeEpUsageError, match="K \\(the last dim\\) contiguous"):
        q.k_major_view(torch.zeros(4, 6).t())

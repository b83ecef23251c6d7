"""Quantization formats (device-agnostic torch): fp8, mxfp8, nvfp4, mxfp4, scale layouts.

Blocks run along the last dim (K); every function accepts any leading shape and works on CPU
and CUDA tensors alike. Dequantizers return float32. Non-finite input is rejected with
`MoeEpUsageError`; with `check_finite=False` a block holding NaN / inf quantizes to a NaN
scale and dequantizes to NaN (`moe_ep.quant.nonfinite`; see docs/quant.md for the exact
rounding, exponent and NaN rules).

Warning: so far only run on CPU; tests/quant/test_quant_cuda.py checks CUDA against CPU
bit-exactly wherever a GPU is present, and has not run yet.
"""

from __future__ import annotations

from moe_ep.quant._codes import (
    E2M1_VALUES,
    FP8_MAX,
    e2m1_codes_to_float32,
    e8m0_to_float32,
    pack_e2m1,
    round_to_e2m1_codes,
    unpack_e2m1,
)
from moe_ep.quant.fp8 import (
    FP8_FC2_ACT_BLOCKS,
    dequantize_fp8_blockwise,
    dequantize_fp8_per_row,
    dequantize_fp8_per_tensor,
    float32_pow2_to_e8m0,
    quantize_fp8_blockwise,
    quantize_fp8_per_row,
    quantize_fp8_per_tensor,
)
from moe_ep.quant.layout import (
    GATE_UP_BLOCKS,
    deinterleave_gate_up,
    interleave_gate_up,
    is_k_major,
    k_major_view,
    make_k_major,
    swizzle_128x4,
    swizzled_128x4_numel,
    unswizzle_128x4,
)
from moe_ep.quant.mx import (
    MX_BLOCK,
    MX_RULES,
    dequantize_mxfp4,
    dequantize_mxfp8,
    mx_block_exponents,
    quantize_mxfp4,
    quantize_mxfp8,
)
from moe_ep.quant.mxfp4_hybrid import (
    HUMMING_MAX_RANGE,
    HYBRID_FC2_BLOCK,
    clamp_mxfp4_exponent_range,
    quantize_fp8_fc2_hybrid,
    quantize_fp8_per_token_hybrid,
)
from moe_ep.quant.nonfinite import nonfinite_to_nan
from moe_ep.quant.nvfp4 import (
    NVFP4_BLOCK,
    dequantize_nvfp4,
    nvfp4_alpha,
    nvfp4_global_scale,
    quantize_nvfp4,
)
from moe_ep.quant.nvfp4_hopper import (
    NVFP4_EPILOGUE_COMPENSATION,
    nvfp4_decode_scale,
    nvfp4_e4m3_operand,
    quantize_nvfp4_decode_scaled,
)

__all__ = [
    "E2M1_VALUES",
    "FP8_FC2_ACT_BLOCKS",
    "FP8_MAX",
    "GATE_UP_BLOCKS",
    "HUMMING_MAX_RANGE",
    "HYBRID_FC2_BLOCK",
    "MX_BLOCK",
    "MX_RULES",
    "NVFP4_BLOCK",
    "NVFP4_EPILOGUE_COMPENSATION",
    "clamp_mxfp4_exponent_range",
    "deinterleave_gate_up",
    "dequantize_fp8_blockwise",
    "dequantize_fp8_per_row",
    "dequantize_fp8_per_tensor",
    "dequantize_mxfp4",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "e2m1_codes_to_float32",
    "e8m0_to_float32",
    "float32_pow2_to_e8m0",
    "interleave_gate_up",
    "is_k_major",
    "k_major_view",
    "make_k_major",
    "mx_block_exponents",
    "nonfinite_to_nan",
    "nvfp4_alpha",
    "nvfp4_decode_scale",
    "nvfp4_e4m3_operand",
    "nvfp4_global_scale",
    "pack_e2m1",
    "quantize_fp8_blockwise",
    "quantize_fp8_fc2_hybrid",
    "quantize_fp8_per_row",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token_hybrid",
    "quantize_mxfp4",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_nvfp4_decode_scaled",
    "round_to_e2m1_codes",
    "swizzle_128x4",
    "swizzled_128x4_numel",
    "unpack_e2m1",
    "unswizzle_128x4",
]

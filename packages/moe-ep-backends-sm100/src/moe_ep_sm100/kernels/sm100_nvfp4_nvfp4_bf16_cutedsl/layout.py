"""Kernel-ready nvfp4 weights and staged inputs of `sm100_nvfp4_nvfp4_bf16_cutedsl` (torch).

Runs on CPU or CUDA tensors alike. Recipe (`moe_ep.quant.quantize_nvfp4`, the drop's own
rule): e2m1 elements packed two per byte (even element in the low nibble), one e4m3 scale
per 16 elements along K, `scale = e4m3(amax * fp32(1/6) * norm_const)`, codes of
`v * (norm_const * (1 / scale))` (docs/quant.md). Weights get one global scale (norm const)
per expert (`nvfp4_global_scale`), activations static ones from the config; the kernel
applies `fc1_alpha = 1 / (input_norm_const * w13_norm_const[e])` and
`fc2_alpha = 1 / (hidden_norm_const * w2_norm_const[e])` after each GEMM and quantizes the
FC2 input with `fc1_norm_const[e] = hidden_norm_const`. This is the portable
`any_nvfp4_nvfp4_bf16_torch` recipe, so the kernel's weights equal the portable ones.

Kernel layout: FC1 rows gate/up interleaved in blocks of 16 (data and scale rows alike; the
scale blocks run along K, so this commutes with quantization); packed weights as K-major
views `fc1 [E_local, H/2, 2I]`, `fc2 [E_local, I/2, H]` bytes (stride 1 on dim 1; the kernel
reads them as `float4_e2m1fn_x2`, i.e. `[E_local, H, 2I]` fp4 elements); scale planes
128x4-swizzled per expert, flattened to `[E_local, ceil128(N) * ceil4(K/16)]` e4m3.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.backends.support.launch_args import ceil_to
from moe_ep.backends.support.staging import check_staging_inputs, stage_routing
from moe_ep.errors import MoeEpUsageError

__all__ = [
    "NVFP4_GATE_UP_BLOCK",
    "Nvfp4Weights",
    "StagedNvfp4Inputs",
    "prepare_nvfp4_weights",
    "stage_nvfp4_inputs",
]

NVFP4_GATE_UP_BLOCK = 16
_BLOCK = 16


@dataclass(frozen=True)
class Nvfp4Weights:
    """One rank's kernel-ready nvfp4 weights (layouts in the module docstring).

    `fc1_alpha`, `fc2_alpha`, `fc1_norm_const`: `[E_local]` fp32.
    """

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor
    fc1_alpha: torch.Tensor
    fc2_alpha: torch.Tensor
    fc1_norm_const: torch.Tensor


def _quantized(
    w: torch.Tensor, s: torch.Tensor | None, gs: torch.Tensor | None, name: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from moe_ep.quant import nvfp4_global_scale, quantize_nvfp4

    e = w.shape[0]
    if s is None:
        if w.dtype not in (torch.bfloat16, torch.float32):
            raise MoeEpUsageError(
                f"{name} must be bf16/fp32 (or packed with scales), got {w.dtype}"
            )
        norm = nvfp4_global_scale(w, dim=(-2, -1))
        packed, scales = quantize_nvfp4(w, norm_const=norm)
        return packed, scales, norm.reshape(e).float()
    if w.dtype != torch.uint8 or s.dtype != torch.float8_e4m3fn:
        raise MoeEpUsageError(
            f"pre-quantized {name} must be packed uint8 with float8_e4m3fn scales, got "
            f"{w.dtype} / {s.dtype}"
        )
    expected = (*w.shape[:-1], w.shape[-1] * 2 // _BLOCK)
    if tuple(s.shape) != expected:
        raise MoeEpUsageError(
            f"{name}_scale must be {list(expected)} (one e4m3 per 16 along K), got {list(s.shape)}"
        )
    norm = torch.ones(e) if gs is None else gs.float().reshape(e)
    return w, s, norm


def prepare_nvfp4_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    input_norm_const: float = 1.0,
    hidden_norm_const: float = 1.0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_global_scale: torch.Tensor | None = None,
    w2_global_scale: torch.Tensor | None = None,
) -> Nvfp4Weights:
    """Weights in the form the nvfp4 kernel reads.

    Args:
        w13: `[E_local, 2I, H]` bf16/fp32 gate rows then up rows, or packed `[E_local, 2I, H/2]`
            uint8 with `w13_scale [E_local, 2I, H/16]` e4m3 (+ optional `w13_global_scale
            [E_local]`, default 1).
        w2: `[E_local, H, I]`, likewise.
        input_norm_const / hidden_norm_const: the config's static activation global scales.
    """
    from moe_ep.quant import interleave_gate_up, nvfp4_alpha, swizzle_128x4

    q13, s13, g13 = _quantized(w13, w13_scale, w13_global_scale, "w13")
    q2, s2, g2 = _quantized(w2, w2_scale, w2_global_scale, "w2")
    e, two_i, h_half = q13.shape
    if tuple(q2.shape) != (e, 2 * h_half, two_i // 4) or two_i % (2 * NVFP4_GATE_UP_BLOCK):
        raise MoeEpUsageError(
            f"w13 {list(w13.shape)} / w2 {list(w2.shape)} must be [E_local, 2I, H] / "
            f"[E_local, H, I] with I a multiple of {NVFP4_GATE_UP_BLOCK}"
        )
    q13 = interleave_gate_up(q13, NVFP4_GATE_UP_BLOCK)
    s13 = interleave_gate_up(s13.view(torch.uint8), NVFP4_GATE_UP_BLOCK).view(s13.dtype)
    swz = lambda s: swizzle_128x4(s.view(torch.uint8)).view(torch.float8_e4m3fn)  # noqa: E731
    return Nvfp4Weights(
        w13=q13.permute(0, 2, 1),
        w13_scales=swz(s13),
        w2=q2.permute(0, 2, 1),
        w2_scales=swz(s2),
        fc1_alpha=torch.as_tensor(nvfp4_alpha(input_norm_const, g13), dtype=torch.float32),
        fc2_alpha=torch.as_tensor(nvfp4_alpha(hidden_norm_const, g2), dtype=torch.float32),
        fc1_norm_const=torch.full((e,), float(hidden_norm_const), dtype=torch.float32),
    )


@dataclass(frozen=True)
class StagedNvfp4Inputs:
    """Staged buffers of one launch; rows `>= num_tokens` are padding.

    `activation [T, H/2]` packed e2m1 bytes (0 in padding rows), `activation_scales
    [T, ceil4(H/16)]` e4m3 (extra columns and padding rows 0), `topk_ids [T, k]` int64 (-1 for
    padded slots and rows), `topk_weights [T, k]` fp32 (0 where the id is -1).
    """

    activation: torch.Tensor
    activation_scales: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    num_tokens: int


def stage_nvfp4_inputs(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    max_tokens: int,
    input_norm_const: float = 1.0,
) -> StagedNvfp4Inputs:
    """Quantize (static global scale `input_norm_const`) and pad inputs into T-row buffers."""
    from moe_ep.quant import quantize_nvfp4

    n, h, _ = check_staging_inputs(
        hidden_states, topk_ids, topk_weights, max_tokens=max_tokens, block=_BLOCK
    )
    dev = hidden_states.device
    act = torch.zeros((max_tokens, h // 2), dtype=torch.uint8, device=dev)
    sf = torch.zeros((max_tokens, ceil_to(h // _BLOCK, 4)), dtype=torch.uint8, device=dev)
    if n:
        packed, scales = quantize_nvfp4(
            hidden_states, norm_const=input_norm_const, check_finite=False
        )
        act[:n] = packed
        sf[:n, : h // _BLOCK] = scales.view(torch.uint8)
    ids, wts = stage_routing(topk_ids, topk_weights, max_tokens, device=dev)
    return StagedNvfp4Inputs(act, sf.view(torch.float8_e4m3fn), ids, wts, n)

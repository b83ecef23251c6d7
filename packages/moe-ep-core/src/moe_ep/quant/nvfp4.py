"""nvfp4: e2m1 elements (two per byte), one e4m3 scale per 16 elements, plus a global scale.

With `norm_const` (the per-tensor fp32 "global scale", `2688 * (1 / amax(tensor))`, see
`nvfp4_global_scale`) and a block's amax16, as the sm100 drop's kernels and host quantizer
compute them (fp32 ops, each rounded once; docs/quant.md cites the lines):

    scale   = e4m3(min(amax16 * fp32(1/6) * norm_const, 448))     (RNE cast)
    acc     = min(norm_const * (1 / float(scale)), FLT_MAX), 0 where scale == 0
    payload = RNE_e2m1(v * acc)                                      (saturating at +-6)

so a block whose scale rounds to 0 stores (signed) zero payloads. With `check_finite=False`
a block holding NaN / inf gets the e4m3 NaN scale (0x7F; the payload codes are then
meaningless, e2m1 has no NaN) and dequantizes to NaN (`moe_ep.quant.nonfinite`). Dequantization is
`e2m1 * float(scale) / norm_const`. In a GEMM the global scales are not folded into the
blocks: both operands are dequantized without them and the product is multiplied by the
per-expert alpha `nvfp4_alpha(norm_const_a, norm_const_b) = 1 / (norm_const_a * norm_const_b)`.
"""

from __future__ import annotations

import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep.quant._codes import (
    E2M1_MAX,
    E2M1_TO_E4M3_SHIFT,
    block_amax,
    e2m1_codes_from_shifted,
    e2m1_codes_to_float32,
    owned_float32,
    pack_e2m1,
    unpack_e2m1,
)
from moe_ep.quant._validate import (
    check_block_divides,
    check_contiguous,
    check_dtype,
    check_finite_amax,
    check_high_precision,
    check_shape,
)
from moe_ep.quant.nonfinite import nan_scale_unless_finite

__all__ = [
    "NVFP4_BLOCK",
    "dequantize_nvfp4",
    "nvfp4_alpha",
    "nvfp4_global_scale",
    "quantize_nvfp4",
]

NVFP4_BLOCK = 16
_E4M3_MAX = 448.0
_MAX_NORM_CONST = 2.0**126
_NORM_NUMERATOR = _E4M3_MAX * E2M1_MAX  # 2688, exact
# 1/6 as the kernels use it (the drop's Nvfp4E2M1RcpLimit); torch rounds a Python-float
# factor of a float32 tensor to fp32, as the kernels' Float32(...) does.
_E2M1_RCP_LIMIT = 1.0 / E2M1_MAX
_FP32_MAX = float(torch.finfo(torch.float32).max)


def tensor_amax(x: torch.Tensor, *, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """amax |x| in float32 of a finite float32 / bf16 / fp16 tensor: one scalar (0 when
    empty), or over `dim` (kept, size 1); the per-tensor / per-expert global scales' input."""
    check_high_precision(x, min_dim=0)
    xf = x.float().abs()
    if dim is None:
        amax = xf.amax() if xf.numel() else xf.new_zeros(())
    else:
        amax = xf.amax(dim=dim, keepdim=True)
    check_finite_amax(amax)
    return amax


def nvfp4_global_scale(
    x: torch.Tensor, *, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """norm_const = 2688 * (1 / amax(x)) in float32 (1.0 where amax is 0, at most 2**126).

    Reciprocal, then multiply (two fp32 roundings, as the sm100 kernels compute it), not
    the correctly rounded quotient 2688 / amax: the two differ by an ulp for about a quarter
    of the amax values (amax 0.109375 gives 24576.001953125, not 24576).

    Args:
        x: float32 / bf16 / fp16 tensor, e.g. all experts' w13 `[E, 2I, H]`.
        dim: None for one scalar over the tensor; dims to reduce (kept, size 1) otherwise,
            e.g. `dim=(-2, -1)` gives one norm_const per expert `[E, 1, 1]`.
    """
    amax = tensor_amax(x, dim=dim)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    # Capped so that a (sub)normal-tiny amax cannot overflow it to inf.
    nc = torch.reciprocal(safe).mul_(_NORM_NUMERATOR).clamp_max_(_MAX_NORM_CONST)
    return torch.where(amax > 0, nc, torch.ones_like(amax))


def nvfp4_alpha(
    norm_const_a: float | torch.Tensor, norm_const_b: float | torch.Tensor
) -> float | torch.Tensor:
    """The GEMM epilogue factor 1 / (norm_const_a * norm_const_b) (per expert if tensors)."""
    return 1.0 / (norm_const_a * norm_const_b)


def _norm_const(norm_const: float | torch.Tensor, x: torch.Tensor) -> float | torch.Tensor:
    if isinstance(norm_const, torch.Tensor):
        check_dtype(norm_const, (torch.float32,), arg="norm_const")
        if norm_const.dim() > 0:
            if norm_const.shape[-1] != 1 or norm_const.dim() > x.dim():
                raise MoeEpUsageError(
                    "norm_const must be a float, a 0-dim tensor or a float32 tensor with a "
                    f"size-1 last dim broadcasting to x {tuple(x.shape)} (e.g. [E, 1, 1]), "
                    f"got shape {tuple(norm_const.shape)}"
                )
            # (torch.broadcast_shapes would import sympy machinery: seconds on first use.)
            aligned = zip(reversed(norm_const.shape), reversed(x.shape), strict=False)
            if any(a not in (1, b) for a, b in aligned):
                raise MoeEpUsageError(
                    f"norm_const shape {tuple(norm_const.shape)} does not broadcast to x "
                    f"{tuple(x.shape)}"
                )
            return norm_const.unsqueeze(-1)  # against the [..., K/16, 16] block view
        return norm_const
    if (
        isinstance(norm_const, bool)
        or not isinstance(norm_const, int | float)
        or not (0 < float(norm_const) < float("inf"))
    ):
        raise MoeEpUsageError(f"norm_const must be a positive finite float, got {norm_const!r}")
    if float(norm_const) == 1.0:
        return 1.0
    # Used as fp32, like a kernel's argument: round the Python float once, here.
    return torch.tensor(float(norm_const), dtype=torch.float32, device=x.device)


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    norm_const: float | torch.Tensor = 1.0,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """nvfp4 quantization (see the module doc for the exact rules).

    Args:
        x: `[..., K]` float32 / bf16 / fp16, finite, K % 16 == 0.
        norm_const: the global scale (float, 0-dim, or float32 `[..., 1]` broadcasting to x,
            e.g. per expert `[E, 1, 1]`); 1.0 means none.
        check_finite: reject NaN / inf (a host sync on CUDA).

    Returns:
        `(packed [..., K/2] uint8, scales [..., K/16] float8_e4m3fn)`; element 2i is in the
        low nibble of byte i.
    """
    check_high_precision(x)
    nb = check_block_divides(x, NVFP4_BLOCK, fmt="nvfp4")
    nc = _norm_const(norm_const, x)
    xv = owned_float32(x).view(*x.shape[:-1], nb, NVFP4_BLOCK)
    amax = block_amax(xv)
    if check_finite:
        check_finite_amax(amax)
    no_nc = isinstance(nc, float)  # 1.0: multiplying by it changes nothing
    finite = torch.isfinite(amax)  # before amax is overwritten: the non-finite rule
    block_scale = amax.mul_(_E2M1_RCP_LIMIT) if no_nc else amax.mul_(_E2M1_RCP_LIMIT).mul_(nc)
    block_scale = nan_scale_unless_finite(block_scale.clamp_(max=_E4M3_MAX), finite)
    scale = block_scale.to(torch.float8_e4m3fn)
    sf = scale.float()
    # acc = nc * (1/sf), capped like the kernels' fmin; a zero scale (inf reciprocal) gives
    # acc 0, so its payloads are signed zeros.
    acc = torch.reciprocal(sf) if no_nc else torch.reciprocal(sf).mul_(nc)
    acc = acc.clamp_(max=_FP32_MAX).masked_fill_(sf == 0, 0.0)
    # One rounding of v * acc, then the exact 2**-6 shift e2m1_codes_from_shifted expects (a
    # power of two changes no rounding above fp32 subnormals; values that small round to zero
    # either way). Folding the shift into acc would round a subnormal acc.
    codes = e2m1_codes_from_shifted(xv.mul_(acc).mul_(E2M1_TO_E4M3_SHIFT))
    return pack_e2m1(codes.view(x.shape)), scale.view(*x.shape[:-1], nb)


def dequantize_nvfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    *,
    norm_const: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """`packed [..., K/2] uint8`, `scales [..., K/16] e4m3` -> `[..., K]` float32.

    Returns e2m1 * float(scale) / norm_const (pass norm_const=1.0 and apply `nvfp4_alpha`
    after a GEMM instead, as the kernels do).
    """
    check_dtype(packed, (torch.uint8,), arg="packed")
    check_dtype(scales, (torch.float8_e4m3fn,), arg="scales")
    check_contiguous(packed, arg="packed")
    k = packed.shape[-1] * 2
    if k % NVFP4_BLOCK:
        raise MoeEpUsageError(
            f"packed.shape[-1] * 2 (K) must be divisible by {NVFP4_BLOCK}, got K={k}"
        )
    nb = k // NVFP4_BLOCK
    lead = tuple(packed.shape[:-1])
    check_shape(scales, (*lead, nb), arg="scales", why="one e4m3 scale per 16 elements")
    vals = e2m1_codes_to_float32(unpack_e2m1(packed)).view(*lead, nb, NVFP4_BLOCK)
    out = (vals * scales.float().unsqueeze(-1)).view(*lead, k)
    if isinstance(norm_const, torch.Tensor) or norm_const != 1.0:
        out = out / norm_const
    return out

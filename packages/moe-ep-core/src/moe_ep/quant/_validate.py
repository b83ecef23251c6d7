"""Input checks shared by the quantizers; every failure is a `MoeEpUsageError`."""

from __future__ import annotations

import torch

from moe_ep.errors import MoeEpUsageError

HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_high_precision(x: object, *, arg: str = "x", min_dim: int = 1) -> torch.Tensor:
    """`x` must be a float32 / bf16 / fp16 tensor with at least `min_dim` dims."""
    if not isinstance(x, torch.Tensor):
        raise MoeEpUsageError(f"{arg} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise MoeEpUsageError(
            f"{arg} must be float32, bfloat16 or float16 to be quantized, got {x.dtype}"
        )
    if x.dim() < min_dim:
        raise MoeEpUsageError(
            f"{arg} must have at least {min_dim} dim(s) (blocks run along the last), "
            f"got shape {tuple(x.shape)}"
        )
    return x


def check_block_divides(x: torch.Tensor, block: int, *, arg: str = "x", fmt: str) -> int:
    """The last dim (K) of `x` must be a multiple of `block`; returns K // block."""
    k = x.shape[-1]
    if k % block != 0:
        raise MoeEpUsageError(
            f"{arg}.shape[-1] (K) must be divisible by the {fmt} block of {block}, got K={k} "
            f"(shape {tuple(x.shape)}); pad K to {((k + block - 1) // block) * block}"
        )
    return k // block


def check_finite_amax(amax: torch.Tensor, *, arg: str = "x") -> None:
    """Reject NaN / inf inputs, detected through their block amax (NaN and inf propagate).

    Warning: on CUDA this is a host sync; pass `check_finite=False` on hot paths.
    """
    if amax.numel() and not bool(torch.isfinite(amax).all()):
        bad = int((~torch.isfinite(amax)).sum())
        raise MoeEpUsageError(
            f"{arg} contains NaN or inf ({bad} block(s) affected); moe_ep.quant rejects "
            "non-finite input instead of encoding it (see docs/quant.md, NaN policy)"
        )


def check_dtype(t: object, dtypes: tuple[torch.dtype, ...], *, arg: str) -> torch.Tensor:
    """`t` must be a tensor with one of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        raise MoeEpUsageError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise MoeEpUsageError(f"{arg} must have dtype {names}, got {t.dtype}")
    return t


def check_contiguous(t: torch.Tensor, *, arg: str) -> None:
    """Packed / scale tensors are read through views and must be contiguous."""
    if not t.is_contiguous():
        raise MoeEpUsageError(
            f"{arg} must be contiguous (strides {tuple(t.stride())} for shape "
            f"{tuple(t.shape)}); call .contiguous() first"
        )


def check_shape(t: torch.Tensor, expected: tuple[int, ...], *, arg: str, why: str) -> None:
    """`t.shape` must equal `expected`."""
    if tuple(t.shape) != tuple(expected):
        raise MoeEpUsageError(
            f"{arg} must have shape {tuple(expected)} ({why}), got {tuple(t.shape)}"
        )

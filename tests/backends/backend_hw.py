"""Which hardware is here, for the backend tests: the one place that words GPU skip reasons."""

from __future__ import annotations

import pytest


def cuda_capability() -> tuple[int, int] | None:
    """Compute capability of cuda:0, or None without a CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))  # type: ignore[return-value]


def require_capability(required: tuple[int, int], label: str) -> None:
    """Skip the calling test unless cuda:0 has exactly `required` (arch-specific cubins)."""
    cap = cuda_capability()
    if cap is None:
        pytest.skip(f"needs a {label} GPU; no CUDA device visible on this machine")
    if cap != required:
        pytest.skip(
            f"needs a {label} GPU (compute capability {required[0]}.{required[1]}), "
            f"cuda:0 is {cap[0]}.{cap[1]}"
        )


def require_capability_at_least(required: tuple[int, int], why: str) -> None:
    """Skip the calling test unless cuda:0 has compute capability >= `required`; `why` says
    what needs it (e.g. PTX only Blackwell assembles)."""
    cap = cuda_capability()
    if cap is None:
        pytest.skip(f"{why}; no CUDA device visible on this machine")
    if cap < required:
        pytest.skip(
            f"{why}: needs compute capability >= {required[0]}.{required[1]}, "
            f"cuda:0 is {cap[0]}.{cap[1]}"
        )

"""Frozen, keyword-only configs of the portable kernels (one per taxonomy name)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from moe_ep.backends.base import KernelConfig
from moe_ep.errors import MoeEpUsageError

__all__ = [
    "Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig",
    "Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig",
    "Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig",
    "PortableConfig",
]


def _positive_float(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise MoeEpUsageError(f"{name} must be a finite float > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PortableConfig(KernelConfig):
    """Options shared by every portable (`any_*_torch`) kernel."""

    swiglu_clamp: float | None = None
    """If set, SwiGLU clamps the gate to `<= c` and the up projection to `[-c, c]`."""
    dedup: bool = True
    """Send a token once per destination rank (not once per top-k slot routed there)."""

    def __post_init__(self) -> None:
        if self.swiglu_clamp is not None:
            _positive_float("swiglu_clamp", self.swiglu_clamp)
        if not isinstance(self.dedup, bool):
            raise MoeEpUsageError(f"dedup must be a bool, got {self.dedup!r}")


@dataclass(frozen=True, kw_only=True)
class Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_bf16_bf16_bf16_torch"


@dataclass(frozen=True, kw_only=True)
class Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_fp8_fp8_bf16_torch"


@dataclass(frozen=True, kw_only=True)
class Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_mxfp8_mxfp8_bf16_torch"


@dataclass(frozen=True, kw_only=True)
class Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_nvfp4_nvfp4_bf16_torch"

    act_global_scale: float = 1.0
    """Static nvfp4 global scale (norm_const) of the FC1 input, like a calibrated input_scale."""
    hidden_global_scale: float = 1.0
    """Static nvfp4 global scale of the FC2 input (the SwiGLU output)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive_float("act_global_scale", self.act_global_scale)
        _positive_float("hidden_global_scale", self.hidden_global_scale)


@dataclass(frozen=True, kw_only=True)
class Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_fp8_fp4_bf16_torch"

"""`Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig`: the nvfp4 kernel's knobs and their rules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.common.config import CutedslConfig

__all__ = ["Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig"]


@dataclass(frozen=True, kw_only=True)
class Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig(CutedslConfig):
    """Blackwell CuTe DSL mega-MoE, nvfp4 activations and weights (e2m1, 16-element e4m3
    block scales, per-tensor fp32 global scale applied as per-expert alpha).

    Hidden and intermediate sizes must be multiples of 64 (the drop's own rule).
    """

    kernel_name: ClassVar[str] = "sm100_nvfp4_nvfp4_bf16_cutedsl"

    input_norm_const: float = 1.0
    """Static global scale (norm const) of the FC1 input's nvfp4 quantization; must be the
    same on every rank (peers' tokens are dequantized with the local copy)."""
    hidden_norm_const: float = 1.0
    """Static global scale of the FC2 input (the SwiGLU output) quantization."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("input_norm_const", "hidden_norm_const"):
            v = getattr(self, field)
            bad = isinstance(v, bool) or not isinstance(v, int | float)
            if bad or not math.isfinite(v) or v <= 0:
                raise MoeEpUsageError(f"{field} must be finite and > 0 (e.g. 1.0), got {v!r}")

"""`Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig`: the mxfp8 kernel's knobs and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep_sm100.common.config import CutedslConfig

__all__ = ["MXFP8_BLOCK", "Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig"]

MXFP8_BLOCK = 32
"""Elements per E8M0 scale of the mxfp8 payloads (the drop's `Mxfp8BlockSize`)."""


@dataclass(frozen=True, kw_only=True)
class Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig(CutedslConfig):
    """Blackwell CuTe DSL mega-MoE (2-CTA), mxfp8 e4m3 with 32-element E8M0 block scales.

    Hidden and intermediate sizes must be multiples of 64 (the drop's own rule).
    """

    kernel_name: ClassVar[str] = "sm100_mxfp8_mxfp8_bf16_cutedsl"

"""`Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig`: the DeepGEMM kernel's knobs and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep_sm100.common.config import Sm100Config

__all__ = ["Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig"]


@dataclass(frozen=True, kw_only=True)
class Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig(Sm100Config):
    """DeepGEMM's Blackwell mega-MoE: fp8 activations (1x32 UE8M0), fp4 weights.

    Hidden and intermediate sizes must be multiples of 512 (DeepGEMM's mega-MoE rule, read
    from its sources; see docs/backends.md).
    """

    kernel_name: ClassVar[str] = "sm100_fp8_fp4_bf16_deepgemm"
    shape_multiple: ClassVar[int] = 512

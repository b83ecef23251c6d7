"""`Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig`: the NVFP4 x FP8 pull kernel's knobs (the
`sm90_pull_nvfp4` drop's `Sm90MegaMoESwapABNvfp4Fp8Kernel`, a subclass of the MXFP4 kernel).

The MXFP4 kernel's fixed contract and geometry rules hold unchanged (the MXFP4 config, which
this one extends: `mxfp4_hybrid`, swap-AB only, bf16 combine, H and I multiples of 128). Two
knobs of the NVFP4 kernel are offered, both honoured:

- `nvfp4_kperm` (0, 32 or 64; default 64, upstream's): the K permutation inside every K32 /
  K64 chunk, applied alike to the weights, to the staged activations and, through the drop's
  `Nvfp4ConversionLayout(kperm=...)`, to the kernel.
- `nvfp4_fc1_k256_overlap` (default False): the kernel's FC1 K256 schedule that overlaps the
  e2m1 -> e4m3 conversion with WGMMA; it needs a K256 tile (`mma_tiler_mnk[2] == 256`).
  FlashInfer's `None` (pick per geometry from its tuned table) is not offered: refused.

The conversion table's banking knobs (`Nvfp4ConversionLayout` `lut_replicas`, `lut_map`,
`sf_stages`) are not offered: the kernel runs their defaults. Upstream has no deprecated
alias for this kernel or its config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.config import (
    MXFP4_K_TILE,
    Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
)

__all__ = ["NVFP4_KPERM_CHOICES", "Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig"]

NVFP4_KPERM_CHOICES = (0, 32, 64)
"""K permutations the drop's `nvfp4_policy.NVFP4_KPERM_CHOICES` accepts."""

_K256 = 2 * MXFP4_K_TILE


@dataclass(frozen=True, kw_only=True)
class Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig(Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig):
    """Hopper pull-style CuTe DSL mega-MoE, e4m3 activations (one fp32 scale per token) x
    nvfp4 weights (e2m1, e4m3 scale per 16 along K, fp32 scale per expert); the portable
    twin is `any_fp8_nvfp4_bf16_torch`. Swap-AB only. Never run on a GPU."""

    kernel_name: ClassVar[str] = "sm90_fp8_nvfp4_bf16_pull_cutedsl"

    nvfp4_kperm: int = 64
    nvfp4_fc1_k256_overlap: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if type(self.nvfp4_kperm) is not int or self.nvfp4_kperm not in NVFP4_KPERM_CHOICES:
            raise MoeEpUsageError(
                f"nvfp4_kperm must be one of {NVFP4_KPERM_CHOICES} (the kernel's K "
                f"permutations), got {self.nvfp4_kperm!r}"
            )
        overlap = self.nvfp4_fc1_k256_overlap
        if not isinstance(overlap, bool):
            raise MoeEpUsageError(
                f"nvfp4_fc1_k256_overlap must be True or False (FlashInfer's None, a pick "
                f"from its tuned table, is not offered), got {overlap!r}"
            )
        if overlap and self.mma_tiler_mnk[2] != _K256:
            raise MoeEpUsageError(
                f"nvfp4_fc1_k256_overlap=True needs a K{_K256} tile (the kernel's FC1 K256 "
                f"schedule), got mma_tiler_mnk={self.mma_tiler_mnk}"
            )

"""`sm100_fp8_fp4_bf16_deepgemm`: DeepGEMM's Blackwell fp8 x fp4 mega-MoE.

Warning:
    Registration, config validation and availability only; `deep_gemm` is not a dependency
    of this workspace (it is built from source against the local CUDA toolkit), so the
    kernel is reported unavailable until it is installed and a launch path is written.
"""

from __future__ import annotations

from typing import ClassVar

from moe_ep.backends.base import RuntimeRequirements
from moe_ep.backends.support.hardware import check_availability
from moe_ep.registry import register_mega_kernel
from moe_ep_sm100._unlaunched import LAUNCH_NOT_WRITTEN, UnlaunchedKernel
from moe_ep_sm100.configs import Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig

__all__ = ["Sm100Fp8Fp4Bf16DeepgemmKernel"]


@register_mega_kernel("sm100_fp8_fp4_bf16_deepgemm", deprecated_aliases=("deep_gemm_mega",))
class Sm100Fp8Fp4Bf16DeepgemmKernel(UnlaunchedKernel):
    """Fused dispatch + fp8 x fp4 grouped GEMMs + combine from the `deep_gemm` package."""

    config_cls: ClassVar[type[Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig]] = (
        Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig
    )
    # deep_gemm allocates its own symmetric buffer through torch; no NVSHMEM bootstrap.
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=False)

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        _, why = check_availability(
            capability=(10, 0),
            arch_label="Blackwell B200/GB200, sm_100a",
            packages=(("deep_gemm", "deep_gemm"),),
        )
        return False, "; ".join([*([why] if why else []), LAUNCH_NOT_WRITTEN])

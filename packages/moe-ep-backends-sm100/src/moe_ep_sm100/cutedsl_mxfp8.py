"""`sm100_mxfp8_mxfp8_bf16_cutedsl`: the Blackwell CuTe DSL mxfp8 mega-MoE (2-CTA) kernel.

Warning:
    No launch path; never run on a GPU (see docs/backends.md). What exists and is tested on
    CPU: config validation, availability, weight preparation and input staging
    (`mxfp8_layout`), and the kernel's arguments built from shapes (`mxfp8_args`), compiled
    for sm_100a by `compile_check` exactly as a launch would build them.
"""

from __future__ import annotations

from typing import ClassVar

from moe_ep.backends.base import RuntimeRequirements
from moe_ep.registry import register_mega_kernel
from moe_ep_sm100._hardware import check_availability
from moe_ep_sm100._unlaunched import LAUNCH_NOT_WRITTEN, UnlaunchedKernel
from moe_ep_sm100.configs import Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig
from moe_ep_sm100.cutedsl_nvfp4 import CUTEDSL_PACKAGES
from moe_ep_sm100.drops import CUTEDSL_DROP

__all__ = ["Sm100Mxfp8Mxfp8Bf16CutedslKernel"]


@register_mega_kernel("sm100_mxfp8_mxfp8_bf16_cutedsl", deprecated_aliases=("mxfp8_cutedsl",))
class Sm100Mxfp8Mxfp8Bf16CutedslKernel(UnlaunchedKernel):
    """Fused dispatch + mxfp8 FC1 + SwiGLU + FC2 + combine (2-CTA MMA), NVSHMEM peers."""

    config_cls: ClassVar[type[Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig]] = (
        Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig
    )
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=True)

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        _, why = check_availability(
            capability=(10, 0),
            arch_label="Blackwell B200/GB200, sm_100a",
            packages=CUTEDSL_PACKAGES,
            drop=CUTEDSL_DROP,
        )
        return False, "; ".join([*([why] if why else []), LAUNCH_NOT_WRITTEN])

"""moe-ep Blackwell (sm100) backends: taxonomy wrappers around the sm100 kernels.

Kernels (registered through the `moe_ep.backends` entry points):
- `sm100_fp8_fp4_bf16_deepgemm` (alias `deep_gemm_mega`): needs the `deep_gemm` package.
- `sm100_nvfp4_nvfp4_bf16_cutedsl` (alias `nvfp4_cutedsl`): CuTe DSL drop.
- `sm100_mxfp8_mxfp8_bf16_cutedsl` (alias `mxfp8_cutedsl`): CuTe DSL drop.

Importing this package is light: configs only. The deprecated config-class aliases
(`DeepGemmMegaMoeConfig`, `Nvfp4CutedslMegaMoeConfig`, `Mxfp8CutedslMegaMoeConfig`) resolve
to the canonical classes with a `DeprecationWarning`.
"""

from __future__ import annotations

from moe_ep.backends.support.configs import lazy_package_attrs
from moe_ep_sm100.configs import (
    Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig,
    Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
)

# Deprecated aliases are importable but left out of __all__ (a star import must not warn).
__all__ = [
    "Sm100Fp8Fp4Bf16DeepgemmKernel",
    "Sm100Mxfp8Mxfp8Bf16CutedslKernel",
    "Sm100Nvfp4Nvfp4Bf16CutedslKernel",
    "Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig",
    "Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig",
    "Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig",
]

_DEPRECATED_CONFIGS: dict[str, type] = {
    "DeepGemmMegaMoeConfig": Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig,
    "Nvfp4CutedslMegaMoeConfig": Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    "Mxfp8CutedslMegaMoeConfig": Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
}
_LAZY = {
    "Sm100Fp8Fp4Bf16DeepgemmKernel": "moe_ep_sm100.deepgemm",
    "Sm100Nvfp4Nvfp4Bf16CutedslKernel": "moe_ep_sm100.cutedsl_nvfp4",
    "Sm100Mxfp8Mxfp8Bf16CutedslKernel": "moe_ep_sm100.cutedsl_mxfp8",
}

__getattr__, __dir__ = lazy_package_attrs(
    "moe_ep_sm100", __all__, deprecated=_DEPRECATED_CONFIGS, lazy=_LAZY
)

"""moe-ep Blackwell (sm100) backends: taxonomy wrappers around the sm100 kernels.

Kernels (registered through the `moe_ep.backends` entry points):
- `sm100_fp8_fp4_bf16_deepgemm` (alias `deep_gemm_mega`): needs the `deep_gemm` package.
- `sm100_nvfp4_nvfp4_bf16_cutedsl` (alias `nvfp4_cutedsl`): CuTe DSL drop.
- `sm100_mxfp8_mxfp8_bf16_cutedsl` (alias `mxfp8_cutedsl`): CuTe DSL drop.
- `sm100_mxfp8_mxfp4_bf16_cutedsl`: the provider export's CuTe DSL drop (no alias upstream).

Each kernel is the subpackage `moe_ep_sm100.kernels.<taxonomy name>`; `common` holds what
they share. Importing this package is light: configs only. The deprecated config-class aliases
(`DeepGemmMegaMoeConfig`, `Nvfp4CutedslMegaMoeConfig`, `Mxfp8CutedslMegaMoeConfig`) resolve
to the canonical classes with a `DeprecationWarning`.
"""

from __future__ import annotations

from moe_ep.backends.support.package_attrs import lazy_package_attrs
from moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.config import (
    Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.config import (
    Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
)

# Deprecated aliases are importable but left out of __all__ (a star import must not warn).
__all__ = [
    "Sm100Fp8Fp4Bf16DeepgemmKernel",
    "Sm100Mxfp8Mxfp4Bf16CutedslKernel",
    "Sm100Mxfp8Mxfp8Bf16CutedslKernel",
    "Sm100Nvfp4Nvfp4Bf16CutedslKernel",
    "Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig",
    "Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig",
    "Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig",
    "Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig",
]

_DEPRECATED_CONFIGS: dict[str, type] = {
    "DeepGemmMegaMoeConfig": Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig,
    "Nvfp4CutedslMegaMoeConfig": Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
    "Mxfp8CutedslMegaMoeConfig": Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
}
_KERNELS = "moe_ep_sm100.kernels"
_LAZY = {
    "Sm100Fp8Fp4Bf16DeepgemmKernel": f"{_KERNELS}.sm100_fp8_fp4_bf16_deepgemm.kernel",
    "Sm100Nvfp4Nvfp4Bf16CutedslKernel": f"{_KERNELS}.sm100_nvfp4_nvfp4_bf16_cutedsl.kernel",
    "Sm100Mxfp8Mxfp8Bf16CutedslKernel": f"{_KERNELS}.sm100_mxfp8_mxfp8_bf16_cutedsl.kernel",
    "Sm100Mxfp8Mxfp4Bf16CutedslKernel": f"{_KERNELS}.sm100_mxfp8_mxfp4_bf16_cutedsl.kernel",
}

__getattr__, __dir__ = lazy_package_attrs(
    "moe_ep_sm100", __all__, deprecated=_DEPRECATED_CONFIGS, lazy=_LAZY
)

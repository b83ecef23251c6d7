"""moe-ep Hopper (sm90) backends: taxonomy wrappers around the vendored sm90 drops.

Kernels (registered through the `moe_ep.backends` entry points):
- `sm90_bf16_bf16_bf16_pull_cutedsl`: CuTe DSL, peers pull bf16 tokens (no deprecated alias).
- `sm90_fp8_fp8_bf16_pull_cutedsl` (alias `sm90_pull_fp8`): CuTe DSL, peers pull tokens.
- `sm90_fp8_fp8_bf16_push_cuda` (alias `sm90_push_fp8`): CUDA, senders push tokens.
- `sm90_fp8_mxfp4_bf16_pull_cutedsl`: CuTe DSL, e4m3 tokens x mxfp4 weights (no alias).
- `sm90_fp8_nvfp4_bf16_pull_cutedsl`: CuTe DSL, e4m3 tokens x nvfp4 weights (no alias).

Each kernel is the subpackage `moe_ep_sm90.kernels.<taxonomy name>`; `common` holds what
they share. Importing this package is light: configs only. Kernel classes, cutlass,
NVSHMEM and the drops load on first use. The deprecated config-class aliases
(`Sm90PullFp8MegaMoeConfig`, `Sm90PushFp8MegaMoeConfig`) resolve to the canonical classes
with a `DeprecationWarning`.
"""

from __future__ import annotations

from moe_ep.backends.support.package_attrs import lazy_package_attrs
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.config import (
    Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.config import (
    Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig,
)

# Deprecated aliases are importable but left out of __all__ (a star import must not warn).
__all__ = [
    "Sm90Bf16Bf16Bf16PullCutedslKernel",
    "Sm90Fp8Fp8Bf16PullCutedslKernel",
    "Sm90Fp8Fp8Bf16PushCudaKernel",
    "Sm90Fp8Mxfp4Bf16PullCutedslKernel",
    "Sm90Fp8Nvfp4Bf16PullCutedslKernel",
    "Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig",
    "Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig",
    "Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig",
    "Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig",
    "Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig",
]

_DEPRECATED_CONFIGS: dict[str, type] = {
    "Sm90PullFp8MegaMoeConfig": Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
    "Sm90PushFp8MegaMoeConfig": Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig,
}
_LAZY = {
    "Sm90Bf16Bf16Bf16PullCutedslKernel": (
        "moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.kernel"
    ),
    "Sm90Fp8Fp8Bf16PullCutedslKernel": "moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.kernel",
    "Sm90Fp8Fp8Bf16PushCudaKernel": "moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.kernel",
    "Sm90Fp8Mxfp4Bf16PullCutedslKernel": (
        "moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.kernel"
    ),
    "Sm90Fp8Nvfp4Bf16PullCutedslKernel": (
        "moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.kernel"
    ),
}

__getattr__, __dir__ = lazy_package_attrs(
    "moe_ep_sm90", __all__, deprecated=_DEPRECATED_CONFIGS, lazy=_LAZY
)

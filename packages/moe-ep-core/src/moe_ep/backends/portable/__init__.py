"""The portable `any_<act>_<weight>_bf16_torch` kernels (CPU with gloo, CUDA with NCCL).

Modules: `comm` (dispatch / combine), `experts` (grouped GEMMs + SwiGLU), `recipes` (per
format quantization), `configs`, `kernel` (the registered classes composing them).
"""

from moe_ep.backends.portable.configs import (
    Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig,
    Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig,
    Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig,
    Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig,
    Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig,
    PortableConfig,
)
from moe_ep.backends.portable.kernel import (
    Bf16TorchKernel,
    Fp8Fp4TorchKernel,
    Fp8TorchKernel,
    Mxfp8TorchKernel,
    Nvfp4TorchKernel,
    PortableTorchKernel,
)

__all__ = [
    "Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig",
    "Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig",
    "Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig",
    "Bf16TorchKernel",
    "Fp8Fp4TorchKernel",
    "Fp8TorchKernel",
    "Mxfp8TorchKernel",
    "Nvfp4TorchKernel",
    "PortableConfig",
    "PortableTorchKernel",
]

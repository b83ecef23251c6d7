"""The portable `any_<act>_<weight>_bf16_torch` kernels (CPU with gloo, CUDA with NCCL).

The seam: `prepare_finalize` (the `PrepareFinalize` protocol: quantize + dispatch, combine;
the `Dispatched` record) and `experts_protocol` (the `Experts` protocol), paired by
`modular.ModularKernel`. Implementations: `all_to_all` (`AllToAllPrepareFinalize` over
`comm`'s uneven all-to-alls), `experts` (`TorchExperts`: grouped GEMMs + SwiGLU), `recipes`
(per format quantization); `configs`, `kernel` (the registered classes composing them).
"""

from moe_ep.backends.portable.all_to_all import AllToAllPrepareFinalize
from moe_ep.backends.portable.configs import (
    Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig,
    Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig,
    Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig,
    Any_Fp8_Mxfp4_Bf16_Torch_MegaMoeConfig,
    Any_Fp8_Nvfp4_Bf16_Torch_MegaMoeConfig,
    Any_Mxfp8_Mxfp4_Bf16_Torch_MegaMoeConfig,
    Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig,
    Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig,
    PortableConfig,
)
from moe_ep.backends.portable.experts import TorchExperts
from moe_ep.backends.portable.experts_protocol import Experts
from moe_ep.backends.portable.kernel import (
    Bf16TorchKernel,
    Fp8Fp4TorchKernel,
    Fp8Mxfp4TorchKernel,
    Fp8Nvfp4TorchKernel,
    Fp8TorchKernel,
    Mxfp8Mxfp4TorchKernel,
    Mxfp8TorchKernel,
    Nvfp4TorchKernel,
    PortableTorchKernel,
)
from moe_ep.backends.portable.modular import ModularKernel
from moe_ep.backends.portable.prepare_finalize import Dispatched, PrepareFinalize

__all__ = [
    "AllToAllPrepareFinalize",
    "Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Mxfp4_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Nvfp4_Bf16_Torch_MegaMoeConfig",
    "Any_Mxfp8_Mxfp4_Bf16_Torch_MegaMoeConfig",
    "Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig",
    "Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig",
    "Bf16TorchKernel",
    "Dispatched",
    "Experts",
    "Fp8Fp4TorchKernel",
    "Fp8Mxfp4TorchKernel",
    "Fp8Nvfp4TorchKernel",
    "Fp8TorchKernel",
    "ModularKernel",
    "Mxfp8Mxfp4TorchKernel",
    "Mxfp8TorchKernel",
    "Nvfp4TorchKernel",
    "PortableConfig",
    "PortableTorchKernel",
    "PrepareFinalize",
    "TorchExperts",
]

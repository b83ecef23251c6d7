"""`sm90_fp8_fp8_bf16_push_cuda`: the Hopper push-style CUDA mega-MoE (fp8 blockwise).

Warning:
    What exists: weight preparation and input staging (`fp8_layout`, tested on CPU); both
    translation units compile for sm_90a with nvcc (`push_build`, `compile_check`; the a2a
    unit in the default test run, the binding unit as a `slow` test); the build of the two
    TVM-FFI modules and their loading (`push_build.build_modules` / `load_modules`), written
    but NEVER RUN. The launch path (the symmetric peer window, the push protocol's rounds:
    dispatch, compact, FC1 / FC2 GEMMs, combine, acks) is NOT WRITTEN: `availability()` says
    so and `compute_staged` raises `MoeEpUnavailableError`.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from moe_ep.backends.base import MegaKernel, RuntimeRequirements
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError
from moe_ep.registry import register_mega_kernel
from moe_ep_sm90._hardware import check_availability
from moe_ep_sm90.configs import Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig
from moe_ep_sm90.drops import PUSH_DROP
from moe_ep_sm90.fp8_layout import (
    StagedInputs,
    check_pack,
    prepare_push_weights,
    stage_push_inputs,
)
from moe_ep_sm90.push_build import PUSH_DEPS_DROP

if TYPE_CHECKING:
    import torch

    from moe_ep.layer.params import FleetParams, MoEEpTensors, MoEWeightPack
    from moe_ep.runtime import Runtime

__all__ = ["LAUNCH_NOT_WRITTEN", "Sm90Fp8Fp8Bf16PushCudaKernel"]

LAUNCH_NOT_WRITTEN = (
    "moe_ep_sm90's launch path for the push-style CUDA drop is not written yet (weights, "
    "staging and the module build exist; the push protocol rounds do not)"
)
_PACKAGES = (("tvm_ffi", "apache-tvm-ffi"),)


@dataclass
class _Staged:
    inputs: StagedInputs
    output: torch.Tensor


@register_mega_kernel("sm90_fp8_fp8_bf16_push_cuda", deprecated_aliases=("sm90_push_fp8",))
class Sm90Fp8Fp8Bf16PushCudaKernel(MegaKernel):
    """Push-style dispatch (senders write into peers' buffers) + fp8 block-scale GEMMs.

    Peer memory comes from the Python side (no NVSHMEM); FC1 is generated with nvcc on the
    serving host at run time, so `nvcc` must be on PATH there.
    """

    config_cls: ClassVar[type[Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig]] = (
        Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig
    )
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=False)

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        _, why = check_availability(
            capability=(9, 0), arch_label="Hopper, sm_90a", packages=_PACKAGES, drop=PUSH_DROP
        )
        reasons = [why] if why else []
        deps = PUSH_DEPS_DROP.reason()
        if deps:
            reasons.append(deps)
        if shutil.which("nvcc") is None:
            reasons.append("nvcc is not on PATH (the drop compiles its FC1 kernel at run time)")
        reasons.append(LAUNCH_NOT_WRITTEN)
        return False, "; ".join(reasons)

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> None:
        """Local checks before any collective: pack shapes, unquantized weights, geometry."""
        check_pack(cls.kernel_name, weights, fleet, world_size, config)

    def __init__(
        self,
        *,
        config: Any,
        fleet: FleetParams,
        runtime: Runtime,
        weights: MoEWeightPack,
    ) -> None:
        if not isinstance(config, Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig):
            raise MoeEpUsageError(
                f"config must be a {Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig.__name__}, "
                f"got {type(config).__name__}"
            )
        super().__init__(config=config, fleet=fleet, runtime=runtime, weights=weights)
        self.prepared = prepare_push_weights(weights.w13, weights.w2)

    def stage_inputs(self, *, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Pad inputs into bf16 / int32 staging buffers (`stage_push_inputs`)."""
        staged = stage_push_inputs(
            tensors.hidden_states,
            tensors.topk_ids,
            tensors.topk_weights,
            max_tokens=self.fleet.max_tokens_per_rank,
        )
        return _Staged(staged, output)

    def compute_staged(self, *, staged: Any) -> torch.Tensor:
        raise MoeEpUnavailableError(LAUNCH_NOT_WRITTEN)

"""The portable kernels: `AllToAllPrepareFinalize` + `TorchExperts` in a `ModularKernel`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moe_ep.backends.portable import cpu_fused
from moe_ep.backends.portable.all_to_all import AllToAllPrepareFinalize, Replicas
from moe_ep.backends.portable.capture_safe import CaptureSafeForward
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
from moe_ep.backends.portable.experts import (
    ROW_BLOCK,
    TorchExperts,
    _grouped_mm_operands_ok,
    expert_gemm_rows,
    expert_gemm_unavailable,
    packs_by_default,
    prepack,
    prepack_unavailable,
)
from moe_ep.backends.portable.modular import ModularKernel
from moe_ep.backends.portable.recipes import (
    Bf16Recipe,
    Fp8BlockRecipe,
    Fp8Fp4Recipe,
    Fp8Mxfp4Recipe,
    Fp8Nvfp4Recipe,
    Mxfp8Mxfp4Recipe,
    Mxfp8Recipe,
    Nvfp4Recipe,
    Recipe,
)
from moe_ep.checks import PackShape, check_weight_pack
from moe_ep.contract import KernelConfig, MegaKernel, RuntimeRequirements, validated_shape
from moe_ep.errors import MoeEpUsageError
from moe_ep.registry import register_mega_kernel
from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

if TYPE_CHECKING:
    from moe_ep.runtime import Runtime

__all__ = [
    "Bf16TorchKernel",
    "Fp8Fp4TorchKernel",
    "Fp8Mxfp4TorchKernel",
    "Fp8Nvfp4TorchKernel",
    "Fp8TorchKernel",
    "Mxfp8Mxfp4TorchKernel",
    "Mxfp8TorchKernel",
    "Nvfp4TorchKernel",
    "PortableTorchKernel",
    "thread_count_keeps_bits",
]


def thread_count_keeps_bits() -> bool:
    """Whether a CPU forward's bits are the same at every thread count (`cpu_threads`): the
    fused library with OpenMP on torch's OpenMP backend, so every `mm` block runs on one
    thread (`experts.run_experts`) and the fused kernels split rows and tiles, never a sum;
    without it the `mm` blocks run on all threads and oneDNN may split their K."""
    lib = cpu_fused.library()
    return (
        lib is not None
        and lib.moe_ep_omp_max_threads() >= 1
        and cpu_fused._torch_uses_openmp()  # the check parallel_workers makes
    )


class PortableTorchKernel(MegaKernel):
    """Portable EP MoE in torch: runs on CPU (gloo) and CUDA (NCCL); the kernels' oracle.

    A `ModularKernel` (`self.modular`) of `AllToAllPrepareFinalize` (quantize, dispatch,
    combine over the runtime's group) and `TorchExperts`, both with the format's recipe; the
    experts read `self.prepared`, the weights prepared once here.

    Duplicate expert ids within a row are legal: each slot is its own (token, slot) pair and
    the duplicates are summed like any other slots.

    Warning: tested on CPU (gloo) only; the CUDA (NCCL) path has never run on a GPU.
    """

    config_cls: ClassVar[type[KernelConfig]] = PortableConfig
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements()
    supports_placement: ClassVar[bool] = True
    supports_unfinalized: ClassVar[bool] = True
    supports_live_tokens: ClassVar[bool] = True
    oracle_format: ClassVar[str]
    """The `moe_ep.oracle` format whose recipe this kernel computes (the CLI checks every
    kernel of the same (act, weight) taxonomy tags against it)."""

    @classmethod
    def make_recipe(cls, config: KernelConfig) -> Recipe:
        raise NotImplementedError

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: KernelConfig
    ) -> PackShape:
        """Local checks of a weight pack (no collective): the generic pack checks, the
        recipe's block multiples and scale planes, finite unquantized weights."""
        recipe = cls.make_recipe(config)
        shape = check_weight_pack(
            weights, fleet, world_size, quantized_dtypes=recipe.quantized_weight_dtypes
        )
        recipe.check_dims(shape.hidden_size, shape.intermediate_size)
        recipe.check_scales(weights)
        if not weights.prequantized:
            for name in ("w13", "w2"):
                t = getattr(weights, name)
                if t.numel() and not bool(torch.isfinite(t).all()):
                    raise MoeEpUsageError(f"{name} has non-finite values (NaN or inf)")
        return shape

    def __init__(
        self,
        *,
        config: KernelConfig,
        fleet: FleetParams,
        runtime: Runtime,
        weights: MoEWeightPack,
    ) -> None:
        if not isinstance(config, self.config_cls):
            raise MoeEpUsageError(
                f"config for {self.kernel_name} must be a {self.config_cls.__name__}, got "
                f"{type(config).__name__}"
            )
        super().__init__(config=config, fleet=fleet, runtime=runtime, weights=weights)
        self.pconfig: PortableConfig = config  # type: ignore[assignment]
        shape = validated_shape(weights, fleet, runtime.world_size, config)
        if shape is None:
            shape = self.validate_weights(weights, fleet, runtime.world_size, config)
        self.e_local = shape.num_local_experts
        self.recipe = self.make_recipe(config)
        dev = runtime.device
        if dev.type == "cpu":
            cpu_fused.library()  # build or load now: MOE_EP_CPU_FUSED=1 fails here, not mid-forward
        elif self.pconfig.cpu_threads is not None:
            raise MoeEpUsageError(
                f"cpu_threads={self.pconfig.cpu_threads} sets the threads of a CPU forward; "
                f"this runtime's device is {dev}: leave it None"
            )
        self.prepared = self.recipe.prepare(weights.to(dev))
        """The weights the experts read at each forward."""
        gemm_rows = self.pconfig.expert_gemm_rows
        pack = self.pconfig.cpu_prepacked_weights
        if pack is None:
            pack = packs_by_default(self.prepared, dev, gemm_rows)
        elif pack:
            why = prepack_unavailable(self.prepared, dev)
            if why is not None:
                raise MoeEpUsageError(
                    f"cpu_prepacked_weights=True cannot apply here: {why}; leave it None or False"
                )
        if pack:
            self.prepared = prepack(self.prepared)
        if gemm_rows:
            why = expert_gemm_unavailable(self.prepared, dev)
            if why is not None:
                raise MoeEpUsageError(
                    f"expert_gemm_rows={gemm_rows} needs the CPU expert GEMM, which cannot run "
                    f"here: {why}; leave it None (the default) or 0"
                )
        if gemm_rows == 0 and self.prepared.kpack13 is not None:
            raise MoeEpUsageError(
                "cpu_prepacked_weights=True packs the weights for the CPU expert GEMM on this "
                "CPU (torch has no oneDNN bf16 GEMMs here), which expert_gemm_rows=0 never "
                "runs: leave one of them at its default"
            )
        self.expert_gemm_rows = (
            expert_gemm_rows(self.prepared, dev) if gemm_rows is None else gemm_rows
        )
        """The crossover this kernel's experts use (`PortableConfig.expert_gemm_rows`)."""
        self.modular = ModularKernel(
            AllToAllPrepareFinalize(
                self.recipe,
                runtime,
                num_local_experts=self.e_local,
                hidden_size=fleet.hidden_size,
                dedup=self.pconfig.dedup,
                placement=fleet.placement,
                replicas=(
                    Replicas(self.expert_gemm_rows, ROW_BLOCK)
                    if fleet.placement is not None and fleet.placement.replicated
                    else None
                ),
                topk_weight_before_fc2=bool(self.pconfig.apply_routing_weights_before_fc2),
            ),
            TorchExperts(self.recipe, self.pconfig.swiglu_clamp, gemm_rows),
        )
        self.capture: CaptureSafeForward | None = None
        """The capture-safe forward (`PortableConfig.capture_safe`), else None."""
        if self.pconfig.capture_safe:
            self.capture = self._capture_safe(fleet, runtime)
            self.capturable = True

    def _capture_safe(self, fleet: FleetParams, runtime: Runtime) -> CaptureSafeForward:
        if fleet.placement is not None and not fleet.placement.is_contiguous:
            raise MoeEpUsageError(
                "capture_safe=True needs the contiguous placement (placement=None): its "
                f"fixed-capacity dispatch does not route to slots, got {fleet.placement!r}"
            )
        p = self.prepared
        if p.alpha13 is not None or p.alpha2 is not None or not _grouped_mm_operands_ok(p):
            raise MoeEpUsageError(
                "capture_safe=True needs torch._grouped_mm's operands: hidden_size and "
                "intermediate_size multiples of 8 and 16-byte aligned weights"
            )
        return CaptureSafeForward(
            runtime,
            num_experts=fleet.num_experts,
            num_local_experts=self.e_local,
            hidden_size=fleet.hidden_size,
            max_tokens=fleet.max_tokens_per_rank,
            dedup=self.pconfig.dedup,
            before_fc2=bool(self.pconfig.apply_routing_weights_before_fc2),
            swiglu_clamp=self.pconfig.swiglu_clamp,
        )

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """torch's intra-op threads at `cpu_threads` inside, the caller's count restored."""
        n = self.pconfig.cpu_threads
        before = torch.get_num_threads()
        if n is None or n == before:
            yield
            return
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def stage_inputs(self, *, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Plan routing and quantize this rank's tokens into the dispatch payload (the
        capture-safe forward: route on device, fill the fixed send slots)."""
        with self._threads():
            if self.capture is not None:
                return self.capture.stage(tensors, output)
            return self.modular.stage(tensors, output)

    def compute_staged(self, *, staged: Any) -> torch.Tensor:
        """Dispatch, run the local experts, return rows and combine into the output."""
        with self._threads():
            if self.capture is not None:
                return self.capture.compute(staged, self.prepared)
            return self.modular.compute(staged, self.prepared)

    def compute_unfinalized(
        self, *, staged: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch, run the local experts, return the rows home unreduced."""
        if self.capture is not None:
            raise MoeEpUsageError(
                "forward_unfinalized() has no capture-safe form: construct the kernel with "
                "capture_safe=False for it"
            )
        with self._threads():
            return self.modular.compute_unfinalized(staged, self.prepared)

    @property
    def rebuilds_weights(self) -> bool:
        """bf16 weights packed for the k order (`cpu_prepacked_weights`): the packed copy
        replaced them, and holds their values exactly."""
        w = self.prepared
        return (
            isinstance(self.recipe, Bf16Recipe)
            and w.kpack13 is not None
            and w.kpack2 is not None
            and w.w13t is None
            and w.w2t is None
        )

    def rebuilt_weights(self) -> MoEWeightPack:
        """The bf16 pack the packed copy holds (see `MegaKernel.rebuilds_weights`)."""
        w = self.prepared
        if not self.rebuilds_weights or w.kpack13 is None or w.kpack2 is None:
            return super().rebuilt_weights()
        return MoEWeightPack(w.kpack13.unpacked(), w.kpack2.unpacked())

    def destroy(self) -> None:
        """Drop the receive buffers (idempotent)."""
        self.modular.clear()
        if self.capture is not None:
            self.capture.clear()


@register_mega_kernel("any_bf16_bf16_bf16_torch")
class Bf16TorchKernel(PortableTorchKernel):
    """bf16 activations and weights (bit-identical across runs and world sizes 1, 2, 4)."""

    oracle_format = "bf16"
    config_cls = Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig

    @classmethod
    def make_recipe(cls, config: KernelConfig) -> Recipe:
        return Bf16Recipe(getattr(config, "fc1_output_high_precision", False))


@register_mega_kernel("any_fp8_fp8_bf16_torch")
class Fp8TorchKernel(PortableTorchKernel):
    """DeepSeek-V3 blockwise fp8: the oracle of the sm90 fp8 kernels."""

    oracle_format = "fp8"
    config_cls = Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig

    @classmethod
    def make_recipe(cls, config: KernelConfig) -> Recipe:
        return Fp8BlockRecipe(
            getattr(config, "fc1_gate_up_interleave", None), getattr(config, "fc2_act_block", None)
        )


@register_mega_kernel("any_mxfp8_mxfp8_bf16_torch")
class Mxfp8TorchKernel(PortableTorchKernel):
    """mxfp8 (E8M0 per 32, ceil rule): the oracle of sm100_mxfp8_mxfp8_bf16_cutedsl."""

    oracle_format = "mxfp8"
    config_cls = Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig

    @classmethod
    def make_recipe(cls, config: KernelConfig) -> Recipe:
        return Mxfp8Recipe()


@register_mega_kernel("any_nvfp4_nvfp4_bf16_torch")
class Nvfp4TorchKernel(PortableTorchKernel):
    """nvfp4 (e4m3 per 16 + global alpha): the oracle of sm100_nvfp4_nvfp4_bf16_cutedsl."""

    oracle_format = "nvfp4"
    config_cls = Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig

    @classmethod
    def make_recipe(cls, config: KernelConfig) -> Recipe:
        act = getattr(config, "act_global_scale", 1.0)
        hid = getattr(config, "hidden_global_scale", 1.0)
        return Nvfp4Recipe(act, hid)


@register_mega_kernel("any_fp8_fp4_bf16_torch")
class Fp8Fp4TorchKernel(PortableTorchKernel):
    """fp8 (1x128, UE8M0) activations x mxfp4 weights: the oracle of the DeepGEMM kernel."""

    oracle_format = "fp8_fp4"
    config_cls = Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig

    @classmethod
    def make_recipe(cls, config: KernelConfig) -> Recipe:
        return Fp8Fp4Recipe()


@register_mega_kernel("any_fp8_mxfp4_bf16_torch")
class Fp8Mxfp4TorchKernel(PortableTorchKernel):
    """fp8 (one fp32 scale per token) x mxfp4 (exponents clamped per expert): the oracle of
    sm90_fp8_mxfp4_bf16_pull_cutedsl (`mxfp4_hybrid`)."""

    oracle_format = "fp8_mxfp4"
    config_cls = Any_Fp8_Mxfp4_Bf16_Torch_MegaMoeConfig

    @classmethod
    def make_recipe(cls, config: KernelConfig) -> Recipe:
        return Fp8Mxfp4Recipe()


@register_mega_kernel("any_fp8_nvfp4_bf16_torch")
class Fp8Nvfp4TorchKernel(PortableTorchKernel):
    """fp8 (one fp32 scale per token) x nvfp4 (per-expert decode scale, e4m3 operand): the
    oracle of sm90_fp8_nvfp4_bf16_pull_cutedsl."""

    oracle_format = "fp8_nvfp4"
    config_cls = Any_Fp8_Nvfp4_Bf16_Torch_MegaMoeConfig

    @classmethod
    def make_recipe(cls, config: KernelConfig) -> Recipe:
        return Fp8Nvfp4Recipe()


@register_mega_kernel("any_mxfp8_mxfp4_bf16_torch")
class Mxfp8Mxfp4TorchKernel(PortableTorchKernel):
    """mxfp8 (normal FC1-input scales) x mxfp4: the oracle of sm100_mxfp8_mxfp4_bf16_cutedsl."""

    oracle_format = "mxfp8_mxfp4"
    config_cls = Any_Mxfp8_Mxfp4_Bf16_Torch_MegaMoeConfig

    @classmethod
    def make_recipe(cls, config: KernelConfig) -> Recipe:
        return Mxfp8Mxfp4Recipe()

"""`sm90_fp8_fp8_bf16_push_cuda`: the Hopper push-style CUDA mega-MoE (fp8 blockwise).

Warning:
    The launch path (`build`: module build and load, the peer checks of `peers`,
    `pipe.PushPipe`: the torch symmetric-memory window, the protocol's rounds) has
    NEVER RUN ON A GPU. What is verified
    on CPU: weight preparation and input staging (`layout`); both translation units
    compile for sm_90a with nvcc (`compile`); the a2a module builds and loads through
    `tvm_ffi` (`slow` test); the window layout; the order and arguments of one round's module
    calls and this class's lifecycle (pooling, ref-counted release, staging, errors) with the
    GPU pieces faked. The GEMM module's host build has never run (it needs the CUDA
    toolkit's curand headers and libcuda).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from moe_ep.backends.support.availability import check_availability, nvcc_reason
from moe_ep.backends.support.launch_args import LaunchGeometry
from moe_ep.backends.support.pooling.pooled_kernel import PooledKernel, StagedCall
from moe_ep.backends.support.pooling.workspace_pool import WorkspacePool
from moe_ep.checks import PackShape
from moe_ep.contract import RuntimeRequirements
from moe_ep.errors import MoeEpUsageError
from moe_ep.registry import register_mega_kernel
from moe_ep_sm90.common.fp8_blockwise import StagedInputs
from moe_ep_sm90.common.fp8_packs import check_pack
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.config import (
    Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.layout import (
    prepare_push_weights,
    push_weights_from_pack,
    stage_push_inputs,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.pipe import PushPipe, PushWeights
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.upstream import PUSH_DEPS_DROP, PUSH_DROP

if TYPE_CHECKING:
    import torch

    from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["Sm90Fp8Fp8Bf16PushCudaKernel"]

_PACKAGES = (("tvm_ffi", "apache-tvm-ffi"),)


def _free(pipe: PushPipe) -> None:
    # The symmetric window is released with its last reference (torch symmetric memory).
    pipe.keepalive.clear()


_POOL: WorkspacePool[PushPipe] = WorkspacePool(free=_free)


def check_launchable(config: Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig) -> None:
    """Knobs the config accepts but the drop's launched configuration cannot honour."""
    if config.gate_up_clamp is not None:
        raise MoeEpUsageError(
            "gate_up_clamp must be None for sm90_fp8_fp8_bf16_push_cuda: the drop's fused "
            f"SwiGLU + quant kernel has no clamp, got {config.gate_up_clamp}"
        )
    if config.use_ue8m0_scales:
        raise MoeEpUsageError(
            "use_ue8m0_scales must be False for sm90_fp8_fp8_bf16_push_cuda: the drop's "
            "dispatch quantizes with fp32 scales"
        )


@register_mega_kernel("sm90_fp8_fp8_bf16_push_cuda", deprecated_aliases=("sm90_push_fp8",))
class Sm90Fp8Fp8Bf16PushCudaKernel(PooledKernel):
    """Push-style dispatch (senders write into peers' buffers) + fp8 block-scale GEMMs.

    Peer memory is a torch symmetric-memory window (no NVSHMEM); the two TVM-FFI modules are
    built with nvcc on first use (cached by sources and toolchain versions), and FC1 / FC2
    GEMM kernels are generated at run time (nvcc / NVRTC), so `nvcc` must be on PATH. Layers
    of one config, geometry and device share one pipe (window, scratch, GEMM buffers).
    """

    config_cls: ClassVar[type[Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig]] = (
        Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig
    )
    requirements: ClassVar[RuntimeRequirements] = RuntimeRequirements(cuda=True, nvshmem=False)
    pool: ClassVar[WorkspacePool[PushPipe]] = _POOL
    build_verb: ClassVar[str] = "build"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        _, why = check_availability(
            capability=(9, 0), arch_label="Hopper, sm_90a", packages=_PACKAGES, drop=PUSH_DROP
        )
        reasons = [why] if why else []
        deps = PUSH_DEPS_DROP.reason()
        if deps:
            reasons.append(deps)
        nvcc = nvcc_reason("the drop compiles its modules and FC1 kernel")
        if nvcc:
            reasons.append(nvcc)
        return not reasons, "; ".join(reasons)

    @classmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: pack shapes, dtypes, a pre-quantized pack's
        fit to the kernel's recipe (`common.fp8_packs`: canonical grouping), geometry, knobs."""
        shape = check_pack(cls.kernel_name, weights, fleet, world_size, config)
        check_launchable(config)
        return shape

    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> PushWeights:
        if weights.prequantized:
            p = push_weights_from_pack(weights.to(device))
        else:
            p = prepare_push_weights(weights.w13.to(device), weights.w2.to(device))
        return PushWeights(p.w13, p.w13_scales, p.w2, p.w2_scales)

    def stage_inputs(self, *, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Pad inputs into bf16 / int32 staging buffers of T rows (`stage_push_inputs`)."""
        g = self._ensure_geometry(tensors.topk_ids.shape[1])
        staged = stage_push_inputs(
            tensors.hidden_states,
            tensors.topk_ids,
            tensors.topk_weights,
            max_tokens=g.max_tokens_per_rank,
        )
        self._entry()
        return StagedCall(staged, output)

    def compute_staged(self, *, staged: Any) -> torch.Tensor:
        """One protocol round over all T staged rows; reduces the live rows into the output."""
        pipe: PushPipe = self._entry()
        s = staged.inputs
        self._launch(pipe, s, staged.output)
        return staged.output

    # -- internals ----------------------------------------------------------------------
    def _compile(self, g: LaunchGeometry) -> PushPipe:
        """Build + load the modules, agree on the peers, create the pipe, compile the GEMMs
        (GPU; never run).

        The peer check (`peers.agree_on_peers`) is the first collective here and comes
        before the window rendezvous: a local failure so far (module build, device query),
        a second host, a shared GPU or a pair without NVLink-native atomics raises the same
        `MoeEpUnavailableError` on every rank.
        """
        from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build, peers
        from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.window import push_window

        a2a: Any = None
        gemm: Any = None
        local_exc: BaseException | None = None
        try:
            built = build.build_modules(build.find_sources())
            a2a, gemm = build.load_modules(built)
            local = peers.local_report(self.runtime.device)
        except Exception as exc:
            local_exc = exc
            local = peers.PeerReport("", -1, "", 0, f"{type(exc).__name__}: {exc}")
        peers.agree_on_peers(
            self.runtime,
            local,
            lambda device, peer: peers.p2p_problem(a2a, device, peer),
            local_exc=local_exc,
        )
        layout = push_window(
            ep_size=g.world_size,
            rank=g.rank,
            num_local_experts=g.experts_per_rank,
            hidden=g.hidden_size,
            top_k=g.top_k,
            token_capacity=g.max_tokens_per_rank,
        )
        pipe = PushPipe.create(
            layout,
            g.intermediate_size,
            a2a=a2a,
            gemm=gemm,
            group=self.runtime.group,
            device=self.runtime.device,
        )
        pipe.prepare_jit(self.prepared)
        return pipe

    def _launch(self, pipe: PushPipe, s: StagedInputs, output: torch.Tensor) -> None:
        pipe.run_round(
            s.activation, s.topk_ids, s.topk_weights, self.prepared, output, s.num_tokens
        )

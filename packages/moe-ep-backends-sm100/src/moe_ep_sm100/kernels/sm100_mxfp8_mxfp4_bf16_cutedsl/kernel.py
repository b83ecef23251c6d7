"""`sm100_mxfp8_mxfp4_bf16_cutedsl`: the Blackwell CuTe DSL mega-MoE kernel with mxfp4 weights
and mxfp8 activations (the provider export's `BlackwellInferenceMegaMoE`, kind `mxfp4_mxfp8`).

Warning:
    NEVER RUN ON A GPU (no Blackwell machine was available). Verified on CPU instead: config
    refusals, weight preparation and input staging against references written from the
    formats' and layouts' definitions (`tests/backends/test_sm100_mxfp8_mxfp4_layout.py`)
    and bit for bit against the portable twin `any_mxfp8_mxfp4_bf16_torch` (`..._twin.py`),
    the kernel compiled for sm_100a from the descriptors and arguments `args` builds (and
    refused for sm_90a), the launch lifecycle with the compile and launch faked
    (`..._kernel.py`), and the real compile / launch / destroy glue against recording fakes
    of cutlass, NVSHMEM and the drop kernel (`..._launch_glue.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from moe_ep.backends.support.availability import check_availability
from moe_ep.backends.support.cutedsl.mega_kernel import StagedBuffers
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry
from moe_ep.registry import register_mega_kernel
from moe_ep_sm100.common.cutedsl import Sm100CutedslKernel
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl import args
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.layout import (
    Mxfp4Weights,
    prepare_mxfp4_weights,
    stage_mxfp8_inputs,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.upstream import NEXT_DROP, load_api

if TYPE_CHECKING:
    from moe_ep.types import MoEEpTensors, MoEWeightPack

__all__ = ["COMBINE_REGION", "PACKAGES", "Sm100Mxfp8Mxfp4Bf16CutedslKernel", "combine_region"]

PACKAGES = (
    ("cutlass", "nvidia-cutlass-dsl"),
    ("cuda.bindings", "cuda-bindings"),
    ("nvshmem", "nvshmem4py-cu13"),
)
"""What the drop imports (cutlass, cuda.bindings) and the launch needs (nvshmem); no triton."""

_FLOORS = (
    ("nvidia-cutlass-dsl", "4.8.0", "the sm100_next_cutedsl_megamoe drop (flashinfer 0.7.4)"),
)

COMBINE_REGION = "nvlink.token_comm.pre_reduced_activation"
"""The kernel's shared-workspace region of bf16 combine cells `[T, k, H]`."""


def combine_region(kernel: Any, g: LaunchGeometry) -> tuple[int, int]:
    """(byte offset, byte count) of the first `max_tokens_per_rank` rows of the kernel's
    combine cells `[T, k, H]` bf16 (T = `args.staged_tokens(g)`), read from its device
    workspace table; `RuntimeError` if the region is not there at that size."""
    t, k, h = args.staged_tokens(g), g.top_k, g.hidden_size
    try:
        ws = kernel._device_workspace
        offset, nbytes = int(ws.offset(COMBINE_REGION)), int(ws.nbytes(COMBINE_REGION))
    except (AttributeError, KeyError, TypeError) as exc:
        raise RuntimeError(
            f"the drop's kernel has no readable {COMBINE_REGION!r} workspace region "
            f"({type(exc).__name__}: {exc}); moe_ep_sm100 must be updated for this drop"
        ) from exc
    if nbytes != t * k * h * 2:
        raise RuntimeError(
            f"the drop's {COMBINE_REGION!r} region is {nbytes} bytes; moe_ep_sm100 expects "
            f"[{t}, {k}, {h}] bf16 ({t * k * h * 2} bytes)"
        )
    return offset, g.max_tokens_per_rank * k * h * 2


@register_mega_kernel("sm100_mxfp8_mxfp4_bf16_cutedsl")
class Sm100Mxfp8Mxfp4Bf16CutedslKernel(Sm100CutedslKernel):
    """Fused pull dispatch + mxfp4 x mxfp8 FC1 + SwiGLU + FC2 + bf16 combine (swap-AB, 2-CTA
    MMA), NVSHMEM peers.

    Weights are quantized once (`prepare_mxfp4_weights`: e2m1 with E8M0 per 32 along K,
    gate/up interleaved by 16, K-major, 128x4-swizzled scales); activations per call to
    e4m3 with linear E8M0 scales; masked routes staged as id -1 with weight 0.
    """

    payload_dtype: ClassVar[torch.dtype] = torch.uint8
    config_cls: ClassVar[type[Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig]] = (
        Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig
    )

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return check_availability(
            capability=(10, 0),
            arch_label="Blackwell B200/GB200, sm_100a",
            packages=PACKAGES,
            floors=_FLOORS,
            drop=NEXT_DROP,
        )

    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> Mxfp4Weights:
        w = weights.to(device)
        return prepare_mxfp4_weights(w.w13, w.w2, w.w13_scale, w.w2_scale)

    def _stage(self, tensors: MoEEpTensors, max_tokens: int) -> StagedBuffers:
        rows = args.staged_tokens(self._ensure_geometry(tensors.topk_ids.shape[1]))
        return stage_mxfp8_inputs(
            tensors.hidden_states, tensors.topk_ids, tensors.topk_weights, max_tokens=rows
        )

    def _tensor_specs(self, g: LaunchGeometry) -> tuple[ArgSpec, ...]:
        return args.tensor_specs(g)

    def _make_kernel(self, g: LaunchGeometry) -> tuple[Any, Any, int]:
        api = load_api()
        kernel, clusters = args.build_kernel(self.cfg, g, api)
        return kernel, api, clusters

    def _combine_region(self, kernel: Any, g: LaunchGeometry) -> tuple[int, int]:
        return combine_region(kernel, g)

    def _call_args(
        self,
        g: LaunchGeometry,
        workspaces: tuple[torch.Tensor, torch.Tensor],
        common: dict[str, Any],
    ) -> dict[str, Any]:
        local, shared = workspaces
        return args.call_args(
            g,
            tensor=common["tensor"],
            workspaces=(int(local.data_ptr()), int(shared.data_ptr())),
            peer_map=common["peer_map"],
            stream=common["stream"],
        )

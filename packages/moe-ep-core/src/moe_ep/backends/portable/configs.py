"""Frozen, keyword-only configs of the portable kernels (one per taxonomy name)."""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass
from typing import ClassVar

from moe_ep.compat.renames import either_name
from moe_ep.contract import KernelConfig
from moe_ep.device import usable_cpus
from moe_ep.errors import MoeEpUsageError
from moe_ep.quant import FP8_FC2_ACT_BLOCKS, GATE_UP_BLOCKS

__all__ = [
    "Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Mxfp4_Bf16_Torch_MegaMoeConfig",
    "Any_Fp8_Nvfp4_Bf16_Torch_MegaMoeConfig",
    "Any_Mxfp8_Mxfp4_Bf16_Torch_MegaMoeConfig",
    "Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig",
    "Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig",
    "PortableConfig",
    "check_bool",
    "check_positive_float",
]


def check_positive_float(name: str, value: object) -> None:
    """`MoeEpUsageError` unless `value` is a finite int or float > 0 (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise MoeEpUsageError(f"{name} must be a finite float > 0, got {value!r}")


def check_bool(name: str, value: object) -> None:
    """`MoeEpUsageError` unless `value` is a bool."""
    if not isinstance(value, bool):
        raise MoeEpUsageError(f"{name} must be a bool, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class PortableConfig(KernelConfig):
    """Options shared by every portable (`any_*_torch`) kernel."""

    capture_safe_formats: ClassVar[bool] = False
    """Whether this format has a capture-safe forward (`capture_safe`)."""

    swiglu_clamp: float | None = None
    """If set, SwiGLU clamps the gate to `<= c` and the up projection to `[-c, c]`."""
    dedup: bool = True
    """Send a token once per destination rank (not once per top-k slot routed there)."""
    apply_routing_weights_before_fc2: bool | None = None
    """True: multiply each pair's SwiGLU output by its top-k weight before the FC2 input is
    quantized (and sum the FC2 outputs unweighted), as the sm100 CuTe DSL kernels
    (`apply_topk_in_fc1`) and DeepGEMM's mega-MoE do; False (None = not given) keeps the
    public math (the weight applied in the fp32 top-k sum). Same value, different rounding.
    flashinfer 0.7.4's name; a bool once constructed."""
    capture_safe: bool = False
    """True: the capture-safe forward (`capture_safe.py`): fixed-capacity dispatch and
    device-only routing, no host synchronisation, so a warmed forward can be captured in a
    CUDA graph (docs/runtime.md, "Graph capture"). bf16 only, contiguous placement, no
    `forward_unfinalized`; refused elsewhere."""
    cpu_threads: int | None = None
    """CPU intra-op threads of this kernel's forward (`torch.set_num_threads` around
    `stage_inputs` and `compute_staged`, the caller's count restored after, also on error);
    None: the process's current count. 1 to the usable CPUs; refused on CUDA. A speed knob
    (`moe-ep tune`): with the fused CPU library the bits do not depend on it (every `mm`
    block runs on one thread, the fused kernels split rows and tiles, not sums)."""
    expert_gemm_rows: int | None = None
    """The experts path crossover: experts with at most this many rows in a forward run the
    CPU expert GEMM (`cpu_fused.expert_gemm`), the others the `mm` blocks; 0: never the
    expert GEMM; None: the measured default by format and CPU
    (`experts.expert_gemm_rows`). The two paths sum in different orders, so a change moves
    bits within the format's tolerance against the oracle: an explicit choice, never tuned.
    With the default, on CPUs with AMX, a quantized format whose operands are exact in bf16
    runs every expert on the expert GEMM in the AMX order, whatever its rows
    (`experts.amx_for_quantized`); an explicit value sends them to the two paths above.
    Needs the CPU and the fused library for values > 0 (refused elsewhere) and the default
    forward (refused with `capture_safe`)."""
    cpu_prepacked_weights: bool | None = None
    """Whether the CPU experts keep their weights in a layout packed at construction. None
    (the default): only where that takes less memory than not packing (below); True: pack
    (refused where it cannot apply); False: never.

    Where torch has oneDNN's bf16 GEMMs: the bf16 experts' weights are also kept in oneDNN's
    blocked GEMM layout (`torch.ops.mkldnn._reorder_linear_weight`), so the `mm` blocks
    (experts above the crossover) skip oneDNN's per-call weight reorder: the same bits
    where each block runs one intra-op thread (tested against `torch.mm`; so the layer runs
    them with the fused CPU library; with `MOE_EP_CPU_FUSED=0` at 2+ threads oneDNN's AMX
    kernels can split the two GEMMs differently: other bits, within the oracle's
    tolerance), 1.04-1.5x faster per GEMM where measured, at the cost of a second copy of
    the bf16 expert weights; bf16 FC1 / FC2 weights only (the bf16 format without
    `fc1_output_high_precision`); never by default.

    Where torch has no oneDNN bf16 GEMMs but the fused library's default bf16 body is the
    AVX2 k order (AVX2 CPUs without AVX-512F): the expert weights packed for the CPU expert
    GEMM's k order instead: their values in bf16 (`cpu_fused.pack_k16`) for bf16 (with
    `fc1_output_high_precision` too) and for the quantized formats whose dequantized weights
    are exact in bf16; fp8's (fp32 block scales: not exact in bf16) as their e4m3 codes and
    scales (`cpu_fused.pack_k16_codes`, decoded in registers; refused for weights with a
    scale of 256 or more, or NaN codes). The packed copy replaces the layer's own `[N, K]`
    weights and codes (the `mm` blocks widen from it), so the layer holds no reference to
    bf16 weights it was given (memory is saved once the caller drops them too; it rebuilds
    them from the packed copy for `apply_placement` / `evict`; quantized layers keep the
    pack they were given) and needs 2
    bytes per weight (fp8: 1 and its scales) where the quantized formats kept 4.5-5 (fp32
    dequantized values and codes): there it is the default (None) for the formats that kept
    fp32 weights (the quantized ones, bf16 with `fc1_output_high_precision`). Every expert
    at or under the crossover (`expert_gemm_rows`; the quantized formats then take bf16's,
    256) sums in the k order (other bits than without it for the experts that change order,
    within the oracle's bound), measured 1.2-1.8x faster per bf16 expert GEMM and 1.5-1.7x
    per bf16 decode forward, 1.6-2.2x per quantized one, on Zen 3; refused there with
    `expert_gemm_rows=0` (None then does not pack). In-place changes to the weight tensors
    after construction are not seen by a packed copy (build the layer again, or
    `apply_placement`). Needs the CPU and one of the two: True is refused at construction
    elsewhere, None packs nothing. Not a `moe-ep tune` knob (it trades memory)."""
    topk_weight_before_fc2: InitVar[bool | None] = None
    """Deprecated alias of `apply_routing_weights_before_fc2` (warns; both with different
    values are refused)."""

    def __post_init__(self, topk_weight_before_fc2: bool | None) -> None:
        if self.swiglu_clamp is not None:
            check_positive_float("swiglu_clamp", self.swiglu_clamp)
        check_bool("dedup", self.dedup)
        check_bool("capture_safe", self.capture_safe)
        if not (self.cpu_prepacked_weights is None or isinstance(self.cpu_prepacked_weights, bool)):
            raise MoeEpUsageError(
                f"cpu_prepacked_weights must be None or a bool, got {self.cpu_prepacked_weights!r}"
            )
        if self.cpu_prepacked_weights and self.capture_safe:
            raise MoeEpUsageError(
                "cpu_prepacked_weights=True is not read by the capture-safe forward (it runs "
                "torch._grouped_mm only): leave it None or False with capture_safe=True"
            )
        cores = usable_cpus()
        n = self.cpu_threads
        if n is not None and (type(n) is not int or not 1 <= n <= cores):
            raise MoeEpUsageError(
                f"cpu_threads must be None or an int from 1 to the {cores} usable CPUs, got {n!r}"
            )
        rows = self.expert_gemm_rows
        if rows is not None and (type(rows) is not int or rows < 0):
            raise MoeEpUsageError(
                f"expert_gemm_rows must be None (the measured default) or an int >= 0, got {rows!r}"
            )
        if rows is not None and self.capture_safe:
            raise MoeEpUsageError(
                f"expert_gemm_rows={rows} is not read by the capture-safe forward (it runs "
                "torch._grouped_mm only): leave it None with capture_safe=True"
            )
        if self.capture_safe and not self.capture_safe_formats:
            raise MoeEpUsageError(
                f"capture_safe=True is not built for {self.kernel_name}: only "
                "any_bf16_bf16_bf16_torch has a capture-safe forward"
            )
        before_fc2 = either_name(
            type(self).__name__,
            "apply_routing_weights_before_fc2",
            self.apply_routing_weights_before_fc2,
            "topk_weight_before_fc2",
            topk_weight_before_fc2,
            default=False,
            deprecated=True,
            stacklevel=4 if type(self).__post_init__ is PortableConfig.__post_init__ else 5,
        )
        check_bool("apply_routing_weights_before_fc2", before_fc2)
        object.__setattr__(self, "apply_routing_weights_before_fc2", before_fc2)


@dataclass(frozen=True, kw_only=True)
class Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_bf16_bf16_bf16_torch"
    capture_safe_formats: ClassVar[bool] = True

    fc1_output_high_precision: bool = False
    """Keep FC1's output in fp32 into SwiGLU, as the fused sm90 bf16 pull kernel does (and
    the oracle's `fc1_output_high_precision`); False rounds it to bf16 as a bf16 GEMM writes
    it (unfused bf16 MoE pipelines)."""

    def __post_init__(self, topk_weight_before_fc2: bool | None) -> None:
        super().__post_init__(topk_weight_before_fc2)
        check_bool("fc1_output_high_precision", self.fc1_output_high_precision)
        if self.capture_safe and self.fc1_output_high_precision:
            raise MoeEpUsageError(
                "capture_safe=True needs fc1_output_high_precision=False (its grouped GEMM "
                "writes FC1's output in bf16)"
            )


@dataclass(frozen=True, kw_only=True)
class Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_fp8_fp8_bf16_torch"

    fc1_gate_up_interleave: int | None = None
    """None: FC1 weights quantize in 128x128 blocks over gate-then-up rows (DeepSeek-V3).
    b in `moe_ep.quant.GATE_UP_BLOCKS` (8, 16, 32): interleave gate/up rows in blocks of b
    (`moe_ep.quant.interleave_gate_up`), quantize 128x128, dequantize, de-interleave; so a
    128-row scale block covers gate and up rows `[64j, 64j+64)` for b=8, the values the
    sm90 pull kernel computes with. Only for bf16/fp32 weights (pre-quantized packs are
    rejected: their scales already fix the grouping)."""
    fc2_act_block: int = 128
    """Elements per fp32 scale of the FC2 input (the SwiGLU output), one of
    `moe_ep.quant.FP8_FC2_ACT_BLOCKS`: 128 (DeepSeek-V3, the sm90 push kernel) or 64 (the
    sm90 pull kernel, its drop's `Fp8Fc2ActivationScaleK`). The FC1 input stays 1x128."""

    def __post_init__(self, topk_weight_before_fc2: bool | None) -> None:
        super().__post_init__(topk_weight_before_fc2)
        if type(self.fc2_act_block) is not int or self.fc2_act_block not in FP8_FC2_ACT_BLOCKS:
            raise MoeEpUsageError(
                f"fc2_act_block must be one of {FP8_FC2_ACT_BLOCKS}, got "
                f"{self.fc2_act_block!r} (64 for the sm90 pull kernel's FC2 input)"
            )
        b = self.fc1_gate_up_interleave
        if b is not None and (type(b) is not int or b not in GATE_UP_BLOCKS):
            raise MoeEpUsageError(
                f"fc1_gate_up_interleave must be None or one of {GATE_UP_BLOCKS}, got {b!r} "
                "(e.g. 8 for the sm90 pull kernel's FC1 scale blocks)"
            )


@dataclass(frozen=True, kw_only=True)
class Any_Mxfp8_Mxfp8_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_mxfp8_mxfp8_bf16_torch"


@dataclass(frozen=True, kw_only=True)
class Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_nvfp4_nvfp4_bf16_torch"

    act_global_scale: float = 1.0
    """Static nvfp4 global scale (norm_const) of the FC1 input, like a calibrated input_scale."""
    hidden_global_scale: float = 1.0
    """Static nvfp4 global scale of the FC2 input (the SwiGLU output)."""

    def __post_init__(self, topk_weight_before_fc2: bool | None) -> None:
        super().__post_init__(topk_weight_before_fc2)
        check_positive_float("act_global_scale", self.act_global_scale)
        check_positive_float("hidden_global_scale", self.hidden_global_scale)


@dataclass(frozen=True, kw_only=True)
class Any_Fp8_Fp4_Bf16_Torch_MegaMoeConfig(PortableConfig):
    kernel_name: ClassVar[str] = "any_fp8_fp4_bf16_torch"


@dataclass(frozen=True, kw_only=True)
class Any_Fp8_Mxfp4_Bf16_Torch_MegaMoeConfig(PortableConfig):
    """The sm90 MXFP4 x FP8 kernel's recipe (`fp8_scale_mode="mxfp4_hybrid"`): H and I
    multiples of 128; see `moe_ep.backends.portable.recipes.Fp8Mxfp4Recipe`."""

    kernel_name: ClassVar[str] = "any_fp8_mxfp4_bf16_torch"


@dataclass(frozen=True, kw_only=True)
class Any_Fp8_Nvfp4_Bf16_Torch_MegaMoeConfig(PortableConfig):
    """The sm90 NVFP4 x FP8 kernel's recipe: fp8_mxfp4's activations, nvfp4 weights with a
    per-expert decode scale; H and I multiples of 128; see
    `moe_ep.backends.portable.recipes.Fp8Nvfp4Recipe`."""

    kernel_name: ClassVar[str] = "any_fp8_nvfp4_bf16_torch"


@dataclass(frozen=True, kw_only=True)
class Any_Mxfp8_Mxfp4_Bf16_Torch_MegaMoeConfig(PortableConfig):
    """The sm100 MXFP4 x MXFP8 kernel's recipe: mxfp8 activations, mxfp4 weights (normal
    E8M0 scales); H and I multiples of 128; see
    `moe_ep.backends.portable.recipes.Mxfp8Mxfp4Recipe`."""

    kernel_name: ClassVar[str] = "any_mxfp8_mxfp4_bf16_torch"

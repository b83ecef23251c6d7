"""`Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig`: the pull kernel's knobs (the drop's
compile-time geometry) and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep.backends.support.config_checks import check_choice
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.common.config import FP8_BLOCK, GATE_UP_BLOCKS, Fp8BlockwiseConfig
from moe_ep_sm90.common.pull_tiles import PULL_GATE_UP_BLOCK, PullTileConfig

__all__ = ["PULL_GATE_UP_BLOCK", "Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig"]

_ACCUM_MODES = ("1xacc", "2xacc")


@dataclass(frozen=True, kw_only=True)
class Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(PullTileConfig, Fp8BlockwiseConfig):
    """Hopper pull-style CuTe DSL mega-MoE, fp8 e4m3 blockwise (1x128 FC1 input, 128x128
    weights; in the kernel the FC2 input is quantized 1x64, the drop's Fp8Fc2ActivationScaleK).

    Knobs mirror the drop's compile-time geometry. Defaults are the drop driver's manual
    defaults (native layout, tile (64, 128, 128), cluster (1, 1, 1)).
    """

    kernel_name: ClassVar[str] = "sm90_fp8_fp8_bf16_pull_cutedsl"
    tile_k_multiple: ClassVar[int] = FP8_BLOCK
    tile_k_why: ClassVar[str] = "the fp8 blockwise scale block"

    accum_mode: str = "1xacc"
    """fp8 WGMMA accumulation: "1xacc" or "2xacc" (promotes partial sums twice as often)."""
    prequantized_fc1_gate_up_interleave: int | None = None
    """For a pre-quantized weight pack only (refused with bf16/fp32 weights): the FC1 row
    grouping its `w13_scale` was computed over. None: canonical 128x128 blocks over the
    stored gate-then-up rows (DeepSeek-V3 checkpoints, the portable fp8 backend's packs);
    usable only where each gate row block's scales equal the up block's at the same offset.
    8, 16 or 32: rows gate/up-interleaved in blocks of that size before blocking (the
    kernel's own grouping; the same scale blocks for all three). See
    `moe_ep_sm90.common.fp8_packs`."""

    def __post_init__(self) -> None:
        self._check_tiles()
        b = self.prequantized_fc1_gate_up_interleave
        if b is not None and (type(b) is not int or b not in GATE_UP_BLOCKS):
            raise MoeEpUsageError(
                f"prequantized_fc1_gate_up_interleave must be None or one of {GATE_UP_BLOCKS}, "
                f"got {b!r} (e.g. 8 for a pack quantized as the kernel does)"
            )
        check_choice(self.accum_mode, _ACCUM_MODES, field="accum_mode")

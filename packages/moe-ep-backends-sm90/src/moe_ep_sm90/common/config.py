"""What the configs of the sm90 kernels share: the fp8 blockwise geometry rules.

Each config is frozen and keyword-only; `__post_init__` checks every knob on its own and
`check_problem()` checks the knobs against a layer's geometry. Both raise `MoeEpUsageError`
naming the field, the rule and the value, before anything is allocated or launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep.backends.support.config_checks import GeometryCheckedConfig

__all__ = ["FP8_BLOCK", "GATE_UP_BLOCKS", "HOPPER_SM_COUNT", "Fp8BlockwiseConfig"]

# fp8 blockwise recipe (DeepSeek-V3): activations 1x128, weights 128x128 blocks.
FP8_BLOCK = 128
# H100 / H200 SM count; the default for max active clusters of a 1x1 cluster.
HOPPER_SM_COUNT = 132
# Gate/up interleave blocks a pre-quantized pack may declare (moe_ep.quant.GATE_UP_BLOCKS;
# not imported: importing this package must stay torch-free).
GATE_UP_BLOCKS = (8, 16, 32)


@dataclass(frozen=True, kw_only=True)
class Fp8BlockwiseConfig(GeometryCheckedConfig):
    """Geometry rules shared by every fp8-blockwise kernel of this package."""

    shape_multiple: ClassVar[int] = FP8_BLOCK
    shape_multiple_why: ClassVar[str] = "the fp8 blockwise scale block"

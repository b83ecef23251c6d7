"""`Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig`: the mxfp8 x mxfp4 kernel's knobs and rules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from moe_ep.backends.support.config_checks import check_choice
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm100.common.config import Sm100Config

__all__ = [
    "COMBINE_DTYPES",
    "MAX_EXPERTS",
    "MAX_ROUTES_PER_RANK",
    "MAX_TOKENS_PER_RANK",
    "MAX_TOP_K",
    "MAX_WORLD_SIZE",
    "MX_BLOCK",
    "Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig",
    "padded_tokens_per_rank",
]

MX_BLOCK = 32
"""Elements per E8M0 scale, weights and activations alike (the drop's `QuantKind.sf_vec_size`)."""

# The drop's routing limits (`sources/communication/token_protocol.py` `TokenSrcMetadata`:
# 8-bit rank and slot fields, a 16-bit token index; `token_comm.py`: 16384 experts).
# `upstream.load_api` checks them against the drop.
MAX_TOP_K = 256
MAX_WORLD_SIZE = 256
MAX_TOKENS_PER_RANK = 1 << 16
MAX_EXPERTS = 16384
MAX_ROUTES_PER_RANK = 2097152
"""Routes (padded tokens x top_k) per rank FlashInfer 0.7.4's adapter admits for this kernel."""

COMBINE_DTYPES = ("bf16",)
"""Combine wire formats moe-ep launches (the drop also has nvfp4 / mxfp8 wires: not wrapped)."""


def padded_tokens_per_rank(max_tokens_per_rank: int, top_k: int) -> int:
    """Rows of the staging buffers: `max_tokens_per_rank` rounded up so that rows x top_k is
    a multiple of 4 (the drop's router reads the routing tensors four int32 at a time)."""
    multiple = 4 // math.gcd(top_k, 4)
    return -(-max_tokens_per_rank // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig(Sm100Config):
    """Blackwell CuTe DSL mega-MoE, mxfp4 (e2m1) weights x mxfp8 (e4m3) activations, one
    E8M0 scale per 32 elements along K, bf16 combine (swap-AB, 2-CTA MMA).

    Hidden and intermediate sizes must be multiples of 128; top_k <= 256, world size <= 256,
    experts <= 16384, max_tokens_per_rank <= 65536 (the drop's routing metadata).
    """

    kernel_name: ClassVar[str] = "sm100_mxfp8_mxfp4_bf16_cutedsl"
    shape_multiple: ClassVar[int] = 128
    shape_multiple_why: ClassVar[str] = (
        "the drop's mxfp4_mxfp8 contract: four 32-element E8M0 scales per 128-wide K tile"
    )

    combine_dtype: str = "bf16"
    """Wire format of the combine: only "bf16" is wrapped."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice(self.combine_dtype, COMBINE_DTYPES, field="combine_dtype")

    def check_problem(self, **geometry: int) -> None:
        """Raise `MoeEpUsageError` if this kernel cannot run the given layer geometry (the
        base rules, then the drop's routing limits)."""
        super().check_problem(**geometry)
        name = self.kernel_name
        for field, limit in (
            ("world_size", MAX_WORLD_SIZE),
            ("num_experts", MAX_EXPERTS),
            ("max_tokens_per_rank", MAX_TOKENS_PER_RANK),
        ):
            if (value := geometry[field]) > limit:
                raise MoeEpUsageError(
                    f"{name}: {field} must be <= {limit} (the drop's routing metadata), got {value}"
                )
        tokens, top_k = geometry["max_tokens_per_rank"], geometry["top_k"]
        routes = padded_tokens_per_rank(tokens, top_k) * top_k
        if routes > MAX_ROUTES_PER_RANK:
            raise MoeEpUsageError(
                f"{name}: max_tokens_per_rank x top_k must be <= {MAX_ROUTES_PER_RANK} routes "
                f"per rank, got {tokens} x {top_k} (padded: {routes})"
            )

    def _check_top_k(self, top_k: int) -> None:
        if top_k > MAX_TOP_K:
            raise MoeEpUsageError(
                f"{self.kernel_name}: top_k must be <= {MAX_TOP_K} (the drop's 8-bit route "
                f"slot field), got {top_k}"
            )

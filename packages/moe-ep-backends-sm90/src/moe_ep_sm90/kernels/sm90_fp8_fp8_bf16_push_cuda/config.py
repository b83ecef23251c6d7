"""`Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig`: the push kernel's knobs and their rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moe_ep.backends.support.config_checks import check_clamp, check_int
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.common.config import Fp8BlockwiseConfig

__all__ = ["Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig"]

# The push drop's combine keeps per-token route lists in registers (its kMaxTopK).
_PUSH_MAX_TOP_K = 8
_PUSH_TOP_K = (1, 2, 4, 6, 8)


@dataclass(frozen=True, kw_only=True)
class Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig(Fp8BlockwiseConfig):
    """Hopper push-style CUDA mega-MoE (fp8 e4m3 blockwise GEMMs, push all-to-all)."""

    kernel_name: ClassVar[str] = "sm90_fp8_fp8_bf16_push_cuda"

    gate_up_clamp: float | None = None
    """SwiGLU clamp: gate <= c, -c <= up <= c; None = no clamp."""
    use_ue8m0_scales: bool = False
    """Round fp8 scales up to powers of two (the DeepGEMM UE8M0 variant of the recipe)."""
    top_k: int | None = None
    """Routes per token, part of the window layout; set it so `warmup()` can build ahead,
    else the first forward builds (collectively)."""

    def __post_init__(self) -> None:
        if self.top_k is not None:
            check_int(self.top_k, field="top_k")
        check_clamp(self.gate_up_clamp, field="gate_up_clamp")
        if not isinstance(self.use_ue8m0_scales, bool):
            raise MoeEpUsageError(f"use_ue8m0_scales must be a bool, got {self.use_ue8m0_scales!r}")

    def _check_top_k(self, top_k: int) -> None:
        if top_k > _PUSH_MAX_TOP_K:
            raise MoeEpUsageError(
                f"{self.kernel_name}: top_k must be <= {_PUSH_MAX_TOP_K}, got {top_k}"
            )
        if top_k not in _PUSH_TOP_K:
            raise MoeEpUsageError(
                f"{self.kernel_name}: top_k must be one of {_PUSH_TOP_K} (the drop's "
                f"specializations), got {top_k}"
            )

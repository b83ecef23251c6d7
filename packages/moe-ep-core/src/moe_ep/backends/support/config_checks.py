"""Config validators shared by the GPU backends' kernel configs (`<kernel>/config.py`).

Every validator raises `MoeEpUsageError` naming the field, the rule and the value received.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from moe_ep.contract import KernelConfig
from moe_ep.errors import MoeEpUsageError

__all__ = [
    "GeometryCheckedConfig",
    "check_choice",
    "check_clamp",
    "check_config_top_k",
    "check_int",
]


def check_clamp(value: float | None, *, field: str) -> None:
    """`value` must be None or a finite number > 0 (the SwiGLU gate/up clamp limit)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MoeEpUsageError(f"{field} must be a float or None, got {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise MoeEpUsageError(f"{field} must be finite and > 0 (e.g. 7.0), got {value!r}")


def check_int(value: object, *, field: str, minimum: int = 1) -> int:
    """`value` must be an int (not a bool) >= `minimum`; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise MoeEpUsageError(f"{field} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise MoeEpUsageError(f"{field} must be >= {minimum}, got {value}")
    return value


def check_choice(value: object, choices: tuple[object, ...], *, field: str) -> None:
    """`value` must be one of `choices`."""
    if value not in choices:
        raise MoeEpUsageError(f"{field} must be one of {choices}, got {value!r}")


WARP_DISPATCH_MAX_TOP_K = 32
"""The CuTe DSL drops' dispatch gives each top-k slot of a token one lane of a warp
(`tokens_per_warp = 32 // num_topk` in their `src/token_comm.py`): above 32 no token is ever
counted and its loop never advances (a GPU hang); their runners refuse num_topk > 32."""


def check_warp_dispatch_top_k(kernel: str, top_k: int) -> None:
    """`MoeEpUsageError` unless `top_k <= WARP_DISPATCH_MAX_TOP_K` (CuTe DSL drops)."""
    if top_k > WARP_DISPATCH_MAX_TOP_K:
        raise MoeEpUsageError(
            f"{kernel}: top_k must be <= {WARP_DISPATCH_MAX_TOP_K} (the drop's dispatch maps "
            f"a token's slots onto one warp's lanes), got {top_k}"
        )


def check_config_top_k(kernel: str, top_k: int, config_top_k: int | None) -> None:
    """The inputs' `top_k` must equal the config's when the config sets one."""
    if config_top_k is not None and top_k != config_top_k:
        raise MoeEpUsageError(
            f"{kernel}: top_k of the inputs ({top_k}) differs from the config's "
            f"top_k ({config_top_k})"
        )


@dataclass(frozen=True, kw_only=True)
class GeometryCheckedConfig(KernelConfig):
    """Base of GPU kernel configs with the geometry rules every GPU kernel shares.

    `check_problem`: positive ints; H and I multiples of `shape_multiple` (the message
    adds `shape_multiple_why`); E divisible by the world size; top_k <= E; then
    `_check_top_k`; then the config's own `top_k` (a field subclasses may declare) against
    the inputs'.
    """

    shape_multiple: ClassVar[int] = 1
    shape_multiple_why: ClassVar[str] = ""

    def check_problem(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        top_k: int,
        num_experts: int,
        world_size: int,
        max_tokens_per_rank: int,
    ) -> None:
        """Raise `MoeEpUsageError` if this kernel cannot run the given layer geometry."""
        for field, value in (
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
            ("top_k", top_k),
            ("num_experts", num_experts),
            ("world_size", world_size),
            ("max_tokens_per_rank", max_tokens_per_rank),
        ):
            check_int(value, field=field)
        kernel, multiple = self.kernel_name, self.shape_multiple
        why = f" ({self.shape_multiple_why})" if self.shape_multiple_why else ""
        for field, value in (
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
        ):
            if value % multiple:
                raise MoeEpUsageError(
                    f"{kernel}: {field} must be a multiple of {multiple}{why}, got {value}"
                )
        if num_experts % world_size:
            raise MoeEpUsageError(
                f"{kernel}: num_experts ({num_experts}) must be divisible by world_size "
                f"({world_size})"
            )
        if top_k > num_experts:
            raise MoeEpUsageError(
                f"{kernel}: top_k ({top_k}) must be <= num_experts ({num_experts})"
            )
        self._check_top_k(top_k)
        check_config_top_k(self.kernel_name, top_k, getattr(self, "top_k", None))

    def _check_top_k(self, top_k: int) -> None:
        """Kernel-specific rules on the inputs' `top_k` (default: none)."""

"""Targets as docs/runbook.md states them, and the status column of the benchmark tables."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

Op = Literal["<=", "<", ">=", ">"]
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
}

OK = "ok"
OVER = "over target"
UNDER = "under target"
NA = "n/a"


@dataclass(frozen=True)
class Target:
    """A bound a measured ratio must keep: `value <op> bound`.

    `unit` "x" reads ratios as multiples (1.3 -> "1.3x"), "%" as percentages of a fraction
    (0.8 -> "80%"). `applies_to` names what it covers when that is not everything plotted
    (e.g. "prefill").
    """

    op: Op
    bound: float
    unit: Literal["x", "%"] = "x"
    applies_to: str = ""

    def __post_init__(self) -> None:
        if self.op not in _COMPARE:
            raise ValueError(f"Target.op must be one of {sorted(_COMPARE)}, got {self.op!r}")
        if not math.isfinite(self.bound):
            raise ValueError(f"Target.bound must be finite, got {self.bound!r}")

    def met(self, value: float) -> bool:
        """Whether `value` keeps the bound (a NaN never does)."""
        return _COMPARE[self.op](value, self.bound)

    def fmt(self, value: float, digits: int = 2) -> str:
        """`value` in this target's unit: "1.23x" or "87%"."""
        if self.unit == "%":
            return f"{value * 100:.0f}%"
        return f"{value:.{digits}f}x"

    def label(self) -> str:
        """The bound as the docs write it, e.g. "<= 1.3x" or ">= 80%"."""
        bound = f"{self.bound * 100:g}%" if self.unit == "%" else f"{self.bound:g}x"
        return f"{self.op} {bound}"


def status(value: float | None, target: Target | None) -> str:
    """ "ok" when `value` keeps `target`; "over target" when it is above an upper bound,
    "under target" when below a lower one; "n/a" when there is no target or no finite
    value to compare."""
    if target is None or value is None or not math.isfinite(value):
        return NA
    if target.met(value):
        return OK
    return OVER if target.op in ("<=", "<") else UNDER


def row_status(checks: Iterable[tuple[str, float | None, Target | None]]) -> str:
    """One status for a table row holding several (name, value, target) ratios: "n/a" when
    none has a target, "ok" when every targeted one is met, else the misses by name, e.g.
    "over target: layer/dense"."""
    results = [(name, status(value, target)) for name, value, target in checks]
    judged = [(name, s) for name, s in results if s != NA]
    if not judged:
        return NA
    missed = [(name, s) for name, s in judged if s != OK]
    if not missed:
        return OK
    kinds = dict.fromkeys(s for _, s in missed)
    return "; ".join(
        f"{kind}: " + ", ".join(name for name, s in missed if s == kind) for kind in kinds
    )


def with_bound_note(
    judged: str, target: Target | None, ratio: float, best: float, label: str
) -> str:
    """`judged` (a status) with a note where `ratio` misses `target` and `best`, the value
    the ratio takes at a floor the layer cannot pass (its time at the dense GEMMs of equal
    FLOPs, or at its bandwidth limit), misses it too: the target is beyond that floor on
    this machine, not only beyond the layer. E.g. "over target: vs_limit (dense GEMMs too:
    1.87x)"."""
    if target is None or target.met(ratio) or target.met(best):
        return judged
    return f"{judged} ({label}: {target.fmt(best)})"


DENSE_TOO = "dense GEMMs too"
"""The note's label for a bandwidth-limit ratio that the dense GEMMs of equal FLOPs miss."""
AT_LIMIT = "even at the bandwidth limit"
"""The note's label for a peer / layer ratio the layer could not reach at its limit."""


# The targets docs/runbook.md states for the portable layer at EP1 (issue 16; `moe-ep
# bench` and `benchmarks/layer_speed.py --sections peers` judge by the same objects).
DECODE_T64 = (64, 2048, 1024, 64, 8)
MID_T512 = (512, 2048, 768, 64, 8)
PREFILL_T4096 = (4096, 2048, 1024, 16, 4)
VS_LIMIT = Target("<=", 1.5, applies_to="decode T=64")
QUANT_VS_LIMIT = Target("<=", 2.0)
PEER_OVER_LAYER_DECODE = Target(">=", 2.0, applies_to="decode T=64")
PEER_OVER_LAYER = Target(">=", 1.0)
VS_DENSE_MID = Target("<=", 1.2, applies_to="T=512")
VS_DENSE_PREFILL = Target("<=", 1.1)
NAIVE_OVER_LAYER = Target(">", 1.0)


def layer_targets(
    dims: tuple[int, int, int, int, int], weight: str, world_size: int, routing: str
) -> dict[str, Target]:
    """The stated targets of one measured row, by ratio name (`vs_bandwidth`, `vs_dense`,
    `peer_over_layer`, `naive_over_layer`): `dims` (T, H, I, E, k), the kernel's weight
    format tag; targets are stated for EP1 with uniform routing only."""
    if world_size != 1 or routing != "uniform":
        return {}
    out: dict[str, Target] = {}
    if weight != "bf16":
        if dims == DECODE_T64:
            out["vs_bandwidth"] = QUANT_VS_LIMIT
        return out
    out["peer_over_layer"] = PEER_OVER_LAYER_DECODE if dims == DECODE_T64 else PEER_OVER_LAYER
    out["naive_over_layer"] = NAIVE_OVER_LAYER
    if dims == DECODE_T64:
        out["vs_bandwidth"] = VS_LIMIT
    if dims == MID_T512:
        out["vs_dense"] = VS_DENSE_MID
    if dims == PREFILL_T4096:
        out["vs_dense"] = VS_DENSE_PREFILL
    return out

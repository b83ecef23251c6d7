"""The knobs each kernel's tuner sweeps: config fields that change speed, never the math.

A knob is a field of the kernel's config class (read where the kernel runs, so honoured);
a candidate value the config class refuses (its own checks, e.g. a tile the kernel cannot
run) is left out of the grid. Fields that change results (clamps, rounding order, formats)
are never knobs. `tests/tune/` checks every declared field exists on its config class.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

Grid = Mapping[str, tuple[Any, ...]]

PORTABLE: Grid = {"dedup": (True, False)}
"""The portable kernels at world size > 1: send a token once per destination rank, or once
per top-k slot (`PortableConfig.dedup`; the same result either way). At world size 1 there
is no communication, so no knob: the experts path crossover and the thread split are
module constants of `moe_ep.backends.portable.experts` / `cpu_fused`, not config fields."""
SM90_PULL: Grid = {
    "mma_tiler_mnk": ((64, 128, 128), (64, 256, 128)),
    "cluster_shape_mnk": ((1, 1, 1), (2, 1, 1)),
    "load_balance_mode": ("static", "atomic_counter"),
}
"""The sm90 pull kernels' tile geometry and scheduler (`PullTileConfig`); never run on a
GPU: declared and exercised with fake timings."""

KNOBS: dict[str, Grid] = {
    "sm90_fp8_fp8_bf16_pull_cutedsl": SM90_PULL,
    "sm90_bf16_bf16_bf16_pull_cutedsl": SM90_PULL,
}
"""GPU kernel name -> its grid; every portable kernel (taxonomy arch `any`) has `PORTABLE`;
any other kernel has no tuning knobs."""


def grid_of(kernel: str, world_size: int | None = None) -> Grid:
    """The grid of `kernel` at `world_size` (None: at any world size); empty when it has
    no knobs there."""
    if kernel.split("_", 1)[0] == "any":
        return PORTABLE if world_size is None or world_size > 1 else {}
    return KNOBS.get(kernel, {})


def candidates(grid: Grid) -> list[dict[str, Any]]:
    """Every combination of the grid's values, in a fixed order (the first is each field's
    first value)."""
    names = list(grid)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*grid.values())]


def from_json(value: Any) -> Any:
    """A knob value read back from JSON: lists become tuples (tile shapes)."""
    return tuple(from_json(v) for v in value) if isinstance(value, list) else value

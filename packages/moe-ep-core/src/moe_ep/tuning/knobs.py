"""The knobs each kernel's tuner sweeps: config fields that change speed, never the math.

A knob is a field of the kernel's config class (read where the kernel runs, so honoured);
a candidate value the config class refuses (its own checks, e.g. a tile the kernel cannot
run) is left out of the grid. Fields that change results (clamps, rounding order, formats)
are never knobs: a cached winner would silently change the outputs of every layer built
afterwards. So the portable experts path crossover (`PortableConfig.expert_gemm_rows`) is
an explicit field, not a knob: the CPU expert GEMM and the `mm` blocks sum in different
orders (`tests/tune/test_portable_knobs.py` shows the bits differ), and the GEMM row block
(`experts.ROW_BLOCK`) stays a constant: it sets the GEMMs' M, and where oneDNN runs bf16
GEMMs nothing shows that another M gives the same bits. `cpu_prepacked_weights` trades
memory (oneDNN's layout: a copy of the weights, the same bits; the k order's: other bits
for some experts): a memory and explicit choice, not a knob. The
portable dispatch has no chunk size to tune: each direction is one uneven
`all_to_all_single` (`comm.exchange`). `tests/cli/test_cli_tune.py` checks every declared
field exists on its config class.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

Grid = Mapping[str, tuple[Any, ...]]

PORTABLE_DEDUP: Grid = {"dedup": (True, False)}
"""The portable kernels at world size > 1: send a token once per destination rank, or once
per top-k slot (`PortableConfig.dedup`; the same result either way)."""
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
"""GPU kernel name -> its grid; every portable kernel (taxonomy arch `any`) has
`portable_grid`; any other kernel has no tuning knobs."""


def cpu_thread_candidates(share: int) -> tuple[int | None, ...]:
    """`PortableConfig.cpu_threads` candidates for a rank whose thread share is `share`
    (what `moe-ep tune` sets torch to: the usable CPUs over the world size): None (that
    share itself, the default, first so it wins ties), then 1, 2, 4, ... below it."""
    fewer = tuple(1 << j for j in range(max(1, share).bit_length()) if 1 << j < share)
    return (None, *fewer)


def portable_grid(world_size: int | None = None, cpus: int | None = None) -> Grid:
    """The portable kernels' grid: `cpu_threads` at every world size (with the fused CPU
    library the bits do not depend on it: `thread_count_keeps_bits`), `dedup` at world size
    > 1 (None: any world size, every knob). `cpus`: the usable CPUs (None: this process's)."""
    from moe_ep.device import usable_cpus

    cores = usable_cpus() if cpus is None else cpus
    share = cores if world_size is None else max(1, cores // world_size)
    threads = {"cpu_threads": cpu_thread_candidates(share)}
    if world_size is None or world_size > 1:
        return {**PORTABLE_DEDUP, **threads}
    return threads


def grid_of(kernel: str, world_size: int | None = None) -> Grid:
    """The grid of `kernel` at `world_size` (None: at any world size); empty when it has
    no knobs there."""
    if kernel.split("_", 1)[0] == "any":
        return portable_grid(world_size)
    return KNOBS.get(kernel, {})


def candidates(grid: Grid) -> list[dict[str, Any]]:
    """Every combination of the grid's values, in a fixed order (the first is each field's
    first value)."""
    names = list(grid)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*grid.values())]


def from_json(value: Any) -> Any:
    """A knob value read back from JSON: lists become tuples (tile shapes)."""
    return tuple(from_json(v) for v in value) if isinstance(value, list) else value

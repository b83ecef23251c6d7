"""Spawn workers of the placement tests (top-level, so they pickle)."""

from __future__ import annotations

from typing import Any

import torch
from layer_cases import KERNELS, Case, make_problem, to_wire, token_split

from moe_ep.placement import Placement


def run_placed(
    rank: int, world_size: int, case: Case, fmt: str, spec: dict[str, Any] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's output rows and load counts of `case` under the placement `spec`."""
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors
    from moe_ep.placement_weights import slice_weights
    from moe_ep.registry import get_kernel
    from moe_ep.types import MoEWeightPack

    p = make_problem(case, world_size)
    e = case.num_experts(world_size)
    placement = None if spec is None else Placement.from_json(spec)
    layout = placement or Placement.contiguous(e, world_size)
    split = token_split(case, world_size)
    lo = sum(split[:rank])
    sl = slice(lo, lo + split[rank])
    backend: Any = KERNELS[fmt]
    if case.config:
        backend = get_kernel(backend).config_cls(**dict(case.config))
    layer = MoEEpLayer(
        BootstrapConfig(world_size, rank, timeout_s=60.0),
        FleetParams(e, max(split), case.hidden, placement=placement),
        slice_weights(MoEWeightPack(p["w13"], p["w2"]), layout, rank),
        backend,
        count_load=True,
    )
    try:
        y = layer(MoEEpTensors(p["x"][sl], p["ids"][sl], p["topk_weights"][sl]))
        return y, layer.expert_load.clone()
    finally:
        layer.destroy()


def placed_worker(
    rank: int, world_size: int, jobs: list[tuple[str, Case, str, dict[str, Any] | None]]
) -> dict[str, Any]:
    """Every (key, case, format, placement) job: output rows (wire form) and load counts."""
    from moe_ep import BootstrapConfig
    from moe_ep.runtime import acquire

    torch.set_num_threads(1)
    keep = acquire(BootstrapConfig(world_size, rank, timeout_s=60.0))
    try:
        out: dict[str, Any] = {}
        for key, case, fmt, spec in jobs:
            y, load = run_placed(rank, world_size, case, fmt, spec)
            out[key] = (to_wire(y), load.tolist())
        return out
    finally:
        keep.release()

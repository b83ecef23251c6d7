"""The problem the capture tests share (test_capture_safe.py: the kernel; test_layer_capture.py:
the layer): MAX_T rows a step, live counts 0..MAX_T different on every rank, padded slots and
a duplicate id, rows past the count NaN; a bf16 portable layer of one rank's experts."""

from __future__ import annotations

from typing import Any

import torch
from layer_cases import Case, make_problem

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEWeightPack
from moe_ep.backends.portable.configs import Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig
from moe_ep.spawn import free_port

MAX_T, H, K, E = 6, 256, 4, 8
SENTINEL = 7.0
"""What a caller's output holds before a forward: rows past the count must keep it."""


def live_count(step: int, rank: int, shift: int) -> int:
    """0..MAX_T over the steps, shifted by `shift` per rank (every rank a different count)."""
    return (step + shift * rank) % (MAX_T + 1)


def step_inputs(
    step: int, rank: int, *, seed: int, shift: int, duplicate: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MAX_T rows, some padded slots and a duplicate id (at `duplicate` = (row, slot), a copy
    of the row's first); rows past the count hold NaN (dispatched, they would poison sums)."""
    g = torch.Generator().manual_seed(seed + 100 * step + rank)
    x = torch.randn(MAX_T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(MAX_T)])
    ids[torch.rand(MAX_T, K, generator=g) < 0.2] = -1
    ids[duplicate] = ids[duplicate[0], 0]
    w = torch.rand(MAX_T, K, generator=g)
    x[live_count(step, rank, shift) :] = float("nan")
    return x, ids, w


def bf16_layer(
    weights: Case, world_size: int, rank: int, *, count_load: bool = False, **config: Any
) -> MoEEpLayer:
    """This rank's experts of `weights` in a bf16 portable layer (`config`: its fields); one
    rank meets over its own loopback store, more over the spawned group's."""
    p = make_problem(weights, world_size)
    el = E // world_size
    s = slice(rank * el, (rank + 1) * el)
    boot = (
        BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
        if world_size == 1
        else BootstrapConfig(world_size, rank, timeout_s=60.0)
    )
    return MoEEpLayer(
        boot,
        FleetParams(E, MAX_T, H),
        MoEWeightPack(p["w13"][s], p["w2"][s]),
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(**config),
        count_load=count_load,
    )

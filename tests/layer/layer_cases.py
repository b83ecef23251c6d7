"""Shared data and spawn workers of the layer tests (top-level, so they pickle)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

KERNELS = {
    "bf16": "any_bf16_bf16_bf16_torch",
    "fp8": "any_fp8_fp8_bf16_torch",
    "mxfp8": "any_mxfp8_mxfp8_bf16_torch",
    "nvfp4": "any_nvfp4_nvfp4_bf16_torch",
    "fp8_fp4": "any_fp8_fp4_bf16_torch",
    "fp8_mxfp4": "any_fp8_mxfp4_bf16_torch",
    "fp8_nvfp4": "any_fp8_nvfp4_bf16_torch",
    "mxfp8_mxfp4": "any_mxfp8_mxfp4_bf16_torch",
}


@dataclass(frozen=True)
class Case:
    """A global problem; `experts=0` means one expert per rank (E_local = 1)."""

    name: str
    tokens: int = 24
    hidden: int = 256
    inter: int = 128
    experts: int = 8
    topk: int = 4
    routing: str = "uniform"  # uniform | skewed (one hot expert, duplicate ids in a row)
    pad_frac: float = 0.0
    first_rank_empty: bool = False
    x_scale: float = 1.0
    seed: int = 0
    config: tuple[tuple[str, Any], ...] = ()
    """Kernel config fields as (name, value) pairs (hashable)."""

    def num_experts(self, world_size: int) -> int:
        return self.experts or world_size


def make_problem(case: Case, world_size: int) -> dict[str, torch.Tensor]:
    """Global inputs and all experts' weights, deterministic in (case, E)."""
    e = case.num_experts(world_size)
    g = torch.Generator().manual_seed(case.seed)
    t, h, i, k = case.tokens, case.hidden, case.inter, case.topk
    x = (torch.randn(t, h, generator=g) * case.x_scale).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    kk = min(k, e)
    ids = torch.stack([torch.randperm(e, generator=g)[:kk] for _ in range(t)])
    if kk < k:  # fewer experts than slots: repeat them (duplicate ids are summed)
        ids = ids.repeat(1, -(-k // kk))[:, :k]
    if case.routing == "skewed":
        hot = e - 1
        take = torch.rand(t, generator=g) < 0.8
        ids[take, 0] = hot
        ids[take & (ids[:, 1] == hot), 1] = 0
        ids[1::5, 1] = ids[1::5, 0]  # duplicate expert in a row: the slots are summed
    if case.pad_frac:
        pad = torch.rand(t, k, generator=g) < case.pad_frac
        ids[pad] = -1
        ids[2] = -1  # one token with no expert at all
    weights = torch.rand(t, k, generator=g)
    return {"x": x, "ids": ids, "topk_weights": weights, "w13": w13, "w2": w2}


def token_split(case: Case, world_size: int) -> list[int]:
    """Tokens per rank (rank 0 gets none when `first_rank_empty` and world_size > 1)."""
    t = case.tokens
    if case.first_rank_empty and world_size > 1:
        rest = world_size - 1
        return [0] + [t // rest + (1 if r < t % rest else 0) for r in range(rest)]
    return [t // world_size + (1 if r < t % world_size else 0) for r in range(world_size)]


def rank_share(
    case: Case, world_size: int, rank: int
) -> tuple[dict[str, torch.Tensor], slice, slice]:
    """The global problem, and rank `rank`'s slices of its experts and of its tokens."""
    p = make_problem(case, world_size)
    el = case.num_experts(world_size) // world_size
    split = token_split(case, world_size)
    lo = sum(split[:rank])
    return p, slice(rank * el, (rank + 1) * el), slice(lo, lo + split[rank])


def to_wire(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> numpy (pickles by value, unlike torch's shared-memory tensors)."""
    return t.contiguous().view(torch.int16).numpy().copy()


def from_wire(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).view(torch.bfloat16)


def run_one(rank: int, world_size: int, case: Case, fmt: str, timeout_s: float) -> torch.Tensor:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep.registry import get_kernel

    p, es, sl = rank_share(case, world_size, rank)
    backend: Any = KERNELS[fmt]
    if case.config:
        backend = get_kernel(backend).config_cls(**dict(case.config))
    layer = MoEEpLayer(
        BootstrapConfig(world_size, rank, timeout_s=timeout_s),
        FleetParams(case.num_experts(world_size), max(token_split(case, world_size)), case.hidden),
        MoEWeightPack(p["w13"][es], p["w2"][es]),
        backend,
    )
    try:
        return layer(MoEEpTensors(p["x"][sl], p["ids"][sl], p["topk_weights"][sl]))
    finally:
        layer.destroy()


def cases_worker(
    rank: int, world_size: int, jobs: list[tuple[Case, str]], repeat_bf16: bool
) -> dict[str, Any]:
    """Run every (case, format) job; returns outputs per job key and run-to-run identity."""
    from moe_ep import BootstrapConfig
    from moe_ep.runtime import acquire

    # One intra-op thread: ranks share 2 cores, and OpenMP spin-waits of oversubscribed
    # threads cost 100x on a loaded box (bit-identity holds for any fixed thread count).
    torch.set_num_threads(1)
    torch.manual_seed(1234 + rank)
    timeout_s = 60.0
    keep = acquire(BootstrapConfig(world_size, rank, timeout_s=timeout_s))  # one bootstrap
    try:
        out: dict[str, Any] = {}
        same_again: dict[str, bool] = {}
        for case, fmt in jobs:
            y = run_one(rank, world_size, case, fmt, timeout_s)
            out[f"{case.name}/{fmt}"] = to_wire(y)
            if repeat_bf16 and fmt == "bf16":
                same_again[case.name] = torch.equal(
                    y, run_one(rank, world_size, case, fmt, timeout_s)
                )
        return {"out": out, "same_again": same_again, "threads": torch.get_num_threads()}
    finally:
        keep.release()

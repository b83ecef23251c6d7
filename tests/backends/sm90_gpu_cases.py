"""Problems and spawned workers of the sm90 and sm100 GPU tests (top-level so they pickle).

Never run on CPU (nor, yet, on a GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GpuCase:
    name: str
    tokens: int = 96
    hidden: int = 1024
    inter: int = 512
    experts_per_rank: int = 4
    topk: int = 4
    routing: str = "uniform"  # uniform | skewed (most routes to expert 0)
    pad_frac: float = 0.0
    seed: int = 0


CASES = [
    GpuCase("basic"),
    GpuCase("padded_slots", pad_frac=0.3, seed=1),
    GpuCase("one_expert_per_rank", experts_per_rank=1, topk=1, seed=2),
    GpuCase("skewed", routing="skewed", seed=3),
    GpuCase("zero_tokens", tokens=0, seed=4),
]
"""The problems both GPU test modules run."""


def fp8_exact_weights(e: int, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`[e, n, k]` fp32 weights the fp8 recipes reproduce exactly under any grouping of
    64-row groups into 128-row blocks: e4m3 values times 2**-12, every (64-row, 128-col)
    block holding one element of magnitude 448 (so every block's scale is 2**-12)."""
    q = (torch.randn(e, n, k, generator=gen) * 96).clamp(-448, 448)
    q = q.to(torch.float8_e4m3fn).float()
    q[:, ::64, ::128] = 448.0
    return q * 2.0**-12


def make_problem(case: GpuCase, world_size: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed)
    e = case.experts_per_rank * world_size
    t = case.tokens * world_size
    x = (torch.randn(t, case.hidden, generator=gen)).to(torch.bfloat16)
    if case.routing == "skewed":
        ids = torch.zeros(t, case.topk, dtype=torch.int64)
        ids[:, 1:] = torch.randint(0, e, (t, case.topk - 1), generator=gen)
    else:
        ids = torch.stack([torch.randperm(e, generator=gen)[: case.topk] for _ in range(t)])
    pad = torch.rand(t, case.topk, generator=gen) < case.pad_frac
    ids[pad] = -1
    w = torch.rand(t, case.topk, generator=gen)
    w13 = fp8_exact_weights(e, 2 * case.inter, case.hidden, gen)
    w2 = fp8_exact_weights(e, case.hidden, case.inter, gen)
    return {"x": x, "ids": ids, "w": w, "w13": w13, "w2": w2}


def run_rank(rank: int, world_size: int, case: GpuCase, kernel: str) -> torch.Tensor:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig

    p = make_problem(case, world_size)
    el = case.experts_per_rank
    rows = slice(rank * case.tokens, (rank + 1) * case.tokens)
    experts = slice(rank * el, (rank + 1) * el)
    backend = (
        Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(top_k=case.topk)
        if kernel == "sm90_fp8_fp8_bf16_pull_cutedsl"
        else kernel
    )
    layer = MoEEpLayer(
        BootstrapConfig(world_size=world_size, rank=rank),
        FleetParams(
            num_experts=el * world_size, max_tokens_per_rank=case.tokens, hidden_size=case.hidden
        ),
        MoEWeightPack(w13=p["w13"][experts], w2=p["w2"][experts]),
        backend,
    )
    try:
        layer.warmup()
        dev = layer.device
        out = layer.forward(
            MoEEpTensors(
                hidden_states=p["x"][rows].to(dev),
                topk_ids=p["ids"][rows].to(dev),
                topk_weights=p["w"][rows].to(dev),
            )
        )
        torch.cuda.synchronize()
        return out.cpu()
    finally:
        layer.destroy()

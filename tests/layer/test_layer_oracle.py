"""Every portable format at EP 1, 2, 4 against the dense oracle; bf16 bit-identity."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from layer_cases import KERNELS, Case, from_wire, make_problem, token_split

from moe_ep.backends.portable.experts import prepack_host_unavailable
from moe_ep.oracle import OracleResult, compare_to_oracle, oracle_forward
from moe_ep.spawn import spawn_local

pytestmark = pytest.mark.multirank

CASES = [
    Case("random"),
    Case("skewed_padded", routing="skewed", pad_frac=0.25, seed=1),
    Case("empty_rank", first_rank_empty=True, pad_frac=0.1, seed=2),
    Case("e_local_1", experts=0, seed=3),
    Case("large", x_scale=300.0, seed=4),
]
EXTRA = [
    (Case("clamp", seed=5, config=(("swiglu_clamp", 0.75),)), "bf16"),
    (Case("clamp", seed=5, config=(("swiglu_clamp", 0.75),)), "fp8"),
    (Case("random_nodedup", config=(("dedup", False),)), "bf16"),
    (
        Case("skewed_nodedup", routing="skewed", pad_frac=0.25, seed=1, config=(("dedup", False),)),
        "bf16",
    ),
]
PREPACKED = (
    [(Case("random_prepacked", config=(("cpu_prepacked_weights", True),)), "bf16")]
    if prepack_host_unavailable(torch.device("cpu")) is None
    else []
)
"""bf16 on prepacked weights where this CPU prepacks (oneDNN's layout, or the expert GEMM's
k order on AVX2 CPUs without oneDNN bf16 GEMMs: every expert in the k order)."""
JOBS = [(c, f) for c in CASES for f in KERNELS] + EXTRA + PREPACKED
WORLD_SIZES = (1, 2, 4)


@cache
def _run(world_size: int) -> dict[str, Any]:
    from layer_cases import cases_worker

    results = spawn_local(cases_worker, world_size, JOBS, True, timeout_s=240)
    merged: dict[str, torch.Tensor] = {}
    for key in results[0]["out"]:
        merged[key] = torch.cat([from_wire(r["out"][key]) for r in results])
    same = all(all(r["same_again"].values()) for r in results)
    return {"out": merged, "same_again": same, "threads": [r["threads"] for r in results]}


@cache
def _oracle(case: Case, fmt: str, world_size: int) -> OracleResult:
    p = make_problem(case, world_size)
    return oracle_forward(
        p["x"],
        p["ids"],
        p["topk_weights"],
        p["w13"],
        p["w2"],
        fmt=fmt,
        swiglu_clamp=dict(case.config).get("swiglu_clamp"),
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_format_matches_oracle(world_size: int) -> None:
    got = _run(world_size)["out"]
    failures = []
    for case, fmt in JOBS:
        out = got[f"{case.name}/{fmt}"]
        assert out.shape == (case.tokens, case.hidden)
        report = compare_to_oracle(out, _oracle(case, fmt, world_size))
        if not report.ok:
            failures.append(f"{case.name}/{fmt} at EP{world_size}: {report}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_padded_slots_and_empty_tokens_give_exact_zero(world_size: int) -> None:
    got = _run(world_size)["out"]
    for case in (CASES[1], CASES[2]):
        ids = make_problem(case, world_size)["ids"]
        dead = (ids < 0).all(dim=1)
        assert bool(dead.any())
        for fmt in KERNELS:
            out = got[f"{case.name}/{fmt}"]
            assert torch.equal(out[dead], torch.zeros_like(out[dead])), (case.name, fmt)


def test_bf16_bit_identical_across_runs_and_world_sizes() -> None:
    runs = {ws: _run(ws) for ws in WORLD_SIZES}
    for ws, r in runs.items():
        assert r["same_again"], f"EP{ws}: a second forward differed bitwise"
    ref = runs[1]["out"]
    bf16_cases = [c for c in CASES if c.experts] + [EXTRA[2][0], EXTRA[3][0]]
    for case in bf16_cases + [c for c, _ in PREPACKED]:
        key = f"{case.name}/bf16"
        for ws in WORLD_SIZES[1:]:
            assert torch.equal(runs[ws]["out"][key], ref[key]), f"{key}: EP{ws} != EP1"
    # dedup on/off moves different bytes but computes the same thing, bit for bit
    assert torch.equal(ref["random_nodedup/bf16"], ref["random/bf16"])
    assert torch.equal(runs[2]["out"]["skewed_nodedup/bf16"], ref["skewed_padded/bf16"])


def test_token_split_covers_every_token() -> None:
    for case in CASES:
        for ws in WORLD_SIZES:
            split = token_split(case, ws)
            assert sum(split) == case.tokens and len(split) == ws
            assert split[0] == 0 or not (case.first_rank_empty and ws > 1)


@pytest.mark.parametrize("fmt", [f for f in KERNELS if f != "bf16"])
def test_quantized_formats_bit_identical_across_world_sizes(fmt: str) -> None:
    """Each quantized format gives the same bits at EP 1, 2 and 4: an expert's rows meet
    its weights in the same order wherever it lives (fp8 on a CPU with AMX: both GEMMs in
    the block-scaled order on codes that the home rank packs, whatever the world size)."""
    runs = {ws: _run(ws) for ws in WORLD_SIZES}
    ref = runs[1]["out"]
    for case in [c for c in CASES if c.experts]:
        key = f"{case.name}/{fmt}"
        for ws in WORLD_SIZES[1:]:
            assert torch.equal(runs[ws]["out"][key], ref[key]), f"{key}: EP{ws} != EP1"

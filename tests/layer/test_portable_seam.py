"""The portable seam: a `PrepareFinalize` and an `Experts` composed by `ModularKernel`.

The portable dispatch (`AllToAllPrepareFinalize`) paired with a naive per-expert loop
written here, and the portable experts (`TorchExperts`) paired with an all-gather
prepare/finalize written here, each against the dense oracle (`moe_ep.oracle`) and bit for
bit against the portable composition: either part works with a partner that shares nothing
with its usual one but the `Dispatched` record and the expert output rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from layer_cases import KERNELS, Case, from_wire, make_problem, rank_share, to_wire

from moe_ep.backends.portable import (
    AllToAllPrepareFinalize,
    Dispatched,
    ModularKernel,
    TorchExperts,
)
from moe_ep.backends.portable.recipes import Bf16Recipe, PreparedWeights, Recipe
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import OracleResult, compare_to_oracle, oracle_forward
from moe_ep.spawn import spawn_local
from moe_ep.types import MoEEpTensors, MoEWeightPack

FORMATS = tuple(KERNELS)
RANDOM = Case("random", seed=21)
SKEWED = Case("skewed_padded", routing="skewed", pad_frac=0.25, seed=22)
EMPTY_RANK = Case("empty_rank", first_rank_empty=True, pad_frac=0.1, seed=23)
BEFORE_FC2 = Case("before_fc2", seed=24, config=(("apply_routing_weights_before_fc2", True),))
CLAMP = Case("clamp", seed=25, config=(("swiglu_clamp", 0.75),))
NODEDUP = Case("nodedup", routing="skewed", seed=26, config=(("dedup", False),))

NAIVE_JOBS = [(c, f) for c in (RANDOM, SKEWED) for f in FORMATS] + [
    (BEFORE_FC2, "mxfp8"),
    (BEFORE_FC2, "nvfp4"),
    (CLAMP, "bf16"),
    (NODEDUP, "bf16"),
]
"""(case, format) run through the all-to-all with the naive experts."""
GATHER_JOBS = [(c, f) for c in (SKEWED, EMPTY_RANK) for f in FORMATS] + [
    (BEFORE_FC2, "mxfp8"),
    (CLAMP, "fp8"),
]
"""(case, format) run through the all-gather with the portable experts."""


# --- the test's own parts ---------------------------------------------------------------


class NaiveExperts:
    """`Experts` as a plain loop over local experts (shares no code with experts.py): the
    pairs of expert e are found by a mask, FC1, SwiGLU (fp32), the recipe's FC2-input
    requantization, FC2, written to their own rows."""

    def __init__(self, recipe: Recipe, swiglu_clamp: float | None) -> None:
        self.recipe = recipe
        self.clamp = swiglu_clamp

    def apply(self, dispatched: Dispatched, weights: PreparedWeights) -> torch.Tensor:
        d = dispatched
        cdt = weights.w13t.dtype
        out = torch.full((int(d.pair_row.numel()), int(weights.w2t.shape[2])), float("nan"))
        for e in range(int(weights.w13t.shape[0])):
            sel = (d.pair_expert == e).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            gu = (d.rows[d.pair_row[sel]].to(cdt) @ weights.w13t[e]).float()
            if weights.alpha13 is not None:
                gu = gu * weights.alpha13[e]
            g, u = gu.chunk(2, dim=1)
            if self.clamp is not None:
                g, u = g.clamp(max=self.clamp), u.clamp(-self.clamp, self.clamp)
            h = F.silu(g) * u
            if d.pair_scale is not None:
                h = h * d.pair_scale[sel, None]
            y = (self.recipe.requantize(h).to(cdt) @ weights.w2t[e]).float()
            if weights.alpha2 is not None:
                y = y * weights.alpha2[e]
            out[sel] = y.bfloat16().float()
        return out.bfloat16()

    def clear(self) -> None:
        pass


def _gather_rows(t: torch.Tensor, counts: list[int], group: Any) -> torch.Tensor:
    """Every rank's first `counts[r]` rows of `t`, concatenated in rank order."""
    most = max(counts)
    padded = t.new_zeros((most, *t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])


def _counts(n: int, group: Any, world_size: int) -> list[int]:
    got = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(got, torch.tensor([n]), group=group)
    return [int(c) for c in got]


@dataclass
class _GatherState:
    output: torch.Tensor
    token_counts: list[int]
    mine: torch.Tensor
    """Flat (global token, slot) index of each pair routed here, in that order."""
    weights: torch.Tensor
    """`[T_global, k]` top-k weights (ones when they were applied before FC2)."""
    valid: torch.Tensor
    """`[T_global, k]`: the slot holds an expert."""


class AllGatherPrepareFinalize:
    """`PrepareFinalize` by all-gathers (no all-to-all, no routing plan): every rank gets
    every token; each takes the (token, slot) pairs of its experts; the finalize gathers
    every rank's expert rows and each rank sums its own tokens' slots in slot order."""

    def __init__(
        self, recipe: Recipe, runtime: Any, e_local: int, hidden: int, before_fc2: bool
    ) -> None:
        self.recipe, self.rt, self.e_local, self.hidden = recipe, runtime, e_local, hidden
        self.before_fc2 = before_fc2

    def stage(self, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        return self.recipe.pack(tensors.hidden_states), tensors, output

    def prepare(self, staged: Any) -> tuple[Dispatched, _GatherState]:
        payload, tensors, output = staged
        g, ws = self.rt.group, self.rt.world_size
        counts = _counts(int(payload.shape[0]), g, ws)
        gathered = _gather_rows(payload, counts, g)
        rows = self.recipe.unpack(gathered, self.hidden)
        # the rows' codes where the experts take them (fp8 on a CPU with AMX), as the
        # portable dispatch hands them over: the same order of sums, the same bits
        keep = self.recipe.keeps_codes(self.rt.device)
        codes = self.recipe.codes_of(gathered, self.hidden) if keep else None
        ids = _gather_rows(tensors.topk_ids.long(), counts, g)
        w = _gather_rows(tensors.topk_weights.float(), counts, g)
        k = int(ids.shape[1])
        lo = self.rt.rank * self.e_local
        flat = ids.reshape(-1)
        mine = ((flat >= lo) & (flat < lo + self.e_local)).nonzero().squeeze(1)
        scale = w.reshape(-1)[mine] if self.before_fc2 else None
        dispatched = Dispatched(rows, mine // k, flat[mine] - lo, scale, codes=codes)
        combine_w = torch.ones_like(w) if self.before_fc2 else w
        return dispatched, _GatherState(output, counts, mine, combine_w, ids >= 0)

    def finalize(self, expert_out: torch.Tensor, state: _GatherState) -> torch.Tensor:
        g, ws = self.rt.group, self.rt.world_size
        pair_counts = _counts(int(state.mine.numel()), g, ws)
        index = _gather_rows(state.mine, pair_counts, g)
        y = _gather_rows(expert_out.float(), pair_counts, g)
        total, k = (int(d) for d in state.weights.shape)
        table = torch.zeros(total * k, self.hidden)
        table[index] = y
        table = table.view(total, k, self.hidden)
        lo = sum(state.token_counts[: self.rt.rank])
        n = state.token_counts[self.rt.rank]
        terms = table[lo : lo + n] * state.weights[lo : lo + n, :, None]
        terms = terms.masked_fill(~state.valid[lo : lo + n, :, None], 0.0)
        acc = torch.zeros(n, self.hidden)
        for j in range(k):  # fp32, slots in increasing order
            acc = acc + terms[:, j]
        return state.output.copy_(acc)

    def clear(self) -> None:
        pass


# --- the workers --------------------------------------------------------------------------


def _forward(rt: Any, case: Case, fmt: str, parts: str) -> torch.Tensor:
    from moe_ep.registry import get_kernel

    p, es, sl = rank_share(case, rt.world_size, rt.rank)
    el = es.stop - es.start
    kernel_cls: Any = get_kernel(KERNELS[fmt])
    config = kernel_cls.config_cls(**dict(case.config))
    recipe = kernel_cls.make_recipe(config)
    prepared = recipe.prepare(MoEWeightPack(p["w13"][es], p["w2"][es]))
    if parts == "gather+torch":
        pf: Any = AllGatherPrepareFinalize(
            recipe, rt, el, case.hidden, config.apply_routing_weights_before_fc2
        )
    else:
        pf = AllToAllPrepareFinalize(
            recipe,
            rt,
            num_local_experts=el,
            hidden_size=case.hidden,
            dedup=config.dedup,
            topk_weight_before_fc2=config.apply_routing_weights_before_fc2,
        )
    if parts == "a2a+naive":
        experts: Any = NaiveExperts(recipe, config.swiglu_clamp)
    else:
        experts = TorchExperts(recipe, config.swiglu_clamp)
    kernel = ModularKernel(pf, experts)
    tensors = MoEEpTensors(p["x"][sl], p["ids"][sl], p["topk_weights"][sl])
    out = torch.empty(sl.stop - sl.start, case.hidden, dtype=torch.bfloat16)
    try:
        return kernel.forward(tensors, out, prepared)
    finally:
        kernel.clear()


def _seam_worker(rank: int, world_size: int, jobs: list[tuple[Case, str, str]]) -> dict[str, Any]:
    from moe_ep import BootstrapConfig
    from moe_ep.runtime import acquire

    torch.set_num_threads(1)
    rt = acquire(BootstrapConfig(world_size, rank, timeout_s=60.0))
    try:
        return {
            f"{case.name}/{fmt}/{parts}": to_wire(_forward(rt, case, fmt, parts))
            for case, fmt, parts in jobs
        }
    finally:
        rt.release()


@cache
def _run(world_size: int) -> dict[str, torch.Tensor]:
    jobs = [(c, f, parts) for c, f in NAIVE_JOBS for parts in ("a2a+naive", "a2a+torch")]
    if world_size > 1:
        jobs += [(c, f, parts) for c, f in GATHER_JOBS for parts in ("gather+torch", "a2a+torch")]
    results = spawn_local(_seam_worker, world_size, list(dict.fromkeys(jobs)), timeout_s=240)
    return {key: torch.cat([from_wire(r[key]) for r in results]) for key in results[0]}


@cache
def _oracle(case: Case, fmt: str, world_size: int) -> OracleResult:
    p = make_problem(case, world_size)
    cfg = dict(case.config)
    return oracle_forward(
        p["x"], p["ids"], p["topk_weights"], p["w13"], p["w2"], fmt=fmt,
        swiglu_clamp=cfg.get("swiglu_clamp"),
        apply_routing_weights_before_fc2=cfg.get("apply_routing_weights_before_fc2"),
    )  # fmt: skip


def _check(world_size: int, jobs: list[tuple[Case, str]], parts: str) -> None:
    got = _run(world_size)
    failures = []
    for case, fmt in jobs:
        out = got[f"{case.name}/{fmt}/{parts}"]
        report = compare_to_oracle(out, _oracle(case, fmt, world_size))
        if not report.ok:
            failures.append(f"{case.name}/{fmt} {parts} at EP{world_size}: {report}")
    assert not failures, "\n".join(failures)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", (1, 2))
def test_portable_dispatch_with_naive_experts_matches_the_oracle(world_size: int) -> None:
    _check(world_size, NAIVE_JOBS, "a2a+naive")


@pytest.mark.multirank
def test_portable_experts_with_an_all_gather_prepare_finalize_match_the_oracle() -> None:
    _check(2, GATHER_JOBS, "gather+torch")


@pytest.mark.multirank
def test_the_all_gather_pairing_is_the_portable_kernel_bit_for_bit() -> None:
    """Each expert sees the same rows in the same (token, slot) order and the top-k sum is
    fp32 in slot order either way, so swapping the prepare/finalize changes no bit."""
    got = _run(2)
    for case, fmt in GATHER_JOBS:
        key = f"{case.name}/{fmt}"
        assert torch.equal(got[f"{key}/gather+torch"], got[f"{key}/a2a+torch"]), key


# --- in process ---------------------------------------------------------------------------


def test_modular_kernel_refuses_a_part_without_its_protocol() -> None:
    experts = TorchExperts(Bf16Recipe())
    with pytest.raises(MoeEpUsageError, match=r"prepare_finalize must implement PrepareFinalize"):
        ModularKernel(experts, experts)  # type: ignore[arg-type]
    pf = AllGatherPrepareFinalize(Bf16Recipe(), None, 1, 8, False)
    with pytest.raises(MoeEpUsageError, match=r"experts must implement Experts .*lacks apply"):
        ModularKernel(pf, pf)  # type: ignore[arg-type]
    kernel = ModularKernel(pf, experts)
    with pytest.raises(MoeEpUsageError, match=r"staged must come from ModularKernel\.stage"):
        kernel.compute(object(), Bf16Recipe().prepare(_tiny_pack()))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"recipe": "bf16"}, r"recipe must be a moe_ep\.backends\.portable\.recipes\.Recipe"),
        ({"num_local_experts": 0}, r"num_local_experts must be an int >= 1, got 0"),
        ({"num_local_experts": 2.0}, r"num_local_experts must be an int >= 1, got 2\.0"),
        ({"hidden_size": 100}, r"hidden_size must be a multiple of 32 for format mxfp8, got 100"),
        ({"dedup": 1}, r"dedup must be a bool, got 1"),
        ({"topk_weight_before_fc2": "yes"}, r"topk_weight_before_fc2 must be a bool, got 'yes'"),
    ],
)
def test_the_all_to_all_part_refuses_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    from moe_ep.backends.portable.recipes import Mxfp8Recipe

    args: dict[str, Any] = {"recipe": Mxfp8Recipe(), "num_local_experts": 2, "hidden_size": 64}
    args.update(kwargs)
    recipe = args.pop("recipe")
    with pytest.raises(MoeEpUsageError, match=message):
        AllToAllPrepareFinalize(recipe, None, **args)  # type: ignore[arg-type]


def test_the_torch_experts_refuse_bad_arguments() -> None:
    with pytest.raises(MoeEpUsageError, match=r"recipe must be a .*Recipe .*got str"):
        TorchExperts("bf16")  # type: ignore[arg-type]
    with pytest.raises(MoeEpUsageError, match=r"swiglu_clamp must be a finite float > 0, got -1"):
        TorchExperts(Bf16Recipe(), -1.0)


def _tiny_pack() -> MoEWeightPack:
    return MoEWeightPack(torch.zeros(1, 4, 8).bfloat16(), torch.zeros(1, 8, 2).bfloat16())


def test_world_size_1_posts_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """At world size 1 the portable kernel runs the same all-to-all path, which posts no
    collective on a group of one rank (its all-to-all is a local copy)."""
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer
    from moe_ep.spawn import free_port

    case = Case("ws1", seed=27, pad_frac=0.2)
    p = make_problem(case, 1)
    layer = MoEEpLayer(
        BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}"),
        FleetParams(case.experts, case.tokens, case.hidden),
        MoEWeightPack(p["w13"], p["w2"]),
        KERNELS["bf16"],
    )
    try:

        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("a collective was posted at world size 1")

        monkeypatch.setattr(dist, "all_to_all_single", refuse)
        out = layer(MoEEpTensors(p["x"], p["ids"], p["topk_weights"]))
    finally:
        layer.destroy()
    assert compare_to_oracle(out, _oracle(case, "bf16", 1)).ok

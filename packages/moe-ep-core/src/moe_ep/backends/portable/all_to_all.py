"""`AllToAllPrepareFinalize`: the portable dispatch and combine over a process group.

Quantize each token on its home rank with the format's recipe, send it to the ranks owning
its experts with uneven `all_to_all_single`s (`comm`), dequantize on arrival; the finalize
returns one row per pair the same way and sums them on the home rank. On a group of one rank
the same path runs with no collective and no copy (`comm`: an all-to-all of one rank hands
its rows on).

Under a `Placement` each pair goes to a physical slot (`moe_ep.placement_routing`): with one
copy per expert that is a lookup done while staging; with replicas the dispatch first
gathers every rank's per-expert pair counts (one small all-gather), which the replica
choice and the experts' path choice need (docs/placement.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe_ep.backends.portable import comm
from moe_ep.backends.portable.configs import check_bool
from moe_ep.backends.portable.prepare_finalize import Dispatched
from moe_ep.backends.portable.recipes import Recipe, check_recipe
from moe_ep.contract import KernelRuntime
from moe_ep.errors import MoeEpUsageError
from moe_ep.placement import Placement
from moe_ep.placement_routing import expert_pair_counts, replica_table, route_to_slots
from moe_ep.runtime import post_and_wait
from moe_ep.types import MoEEpTensors

__all__ = ["AllToAllPrepareFinalize", "Replicas"]


@dataclass
class _Staged:
    output: torch.Tensor
    plan: comm.DispatchPlan | None
    """None under replicas: planned in `prepare`, once the counts are gathered."""
    payload: torch.Tensor
    """The rows to send in plan order; with `plan` None, every token's row."""
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor | None = None
    """Kept for `prepare` when `plan` is None."""
    dequantized: bool = False
    """`payload` already holds `recipe.unpack(recipe.pack(rows))` (a group of one rank:
    nothing is sent, `Recipe.pack_unpack` did both in one pass)."""
    rows: torch.Tensor | None = None
    """Beside a packed `payload`, its rows' `recipe.unpack(recipe.pack(rows))` (a group of
    one rank whose experts take the codes: the payload stays, row for row, and the one-pass
    `Recipe.pack_unpack` spares the unpack)."""


@dataclass(frozen=True)
class Replicas:
    """How `AllToAllPrepareFinalize` spreads the pairs of a replicated expert.

    spread_rows: experts with at most this many pairs in a forward (over all ranks) are
        spread pair by pair: the experts compute their rows independently of one another.
    row_block: above that, runs of this many pairs (the experts' GEMM block) are spread.
    """

    spread_rows: int
    row_block: int

    def __post_init__(self) -> None:
        for name, low in (("spread_rows", 0), ("row_block", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < low:
                raise MoeEpUsageError(f"Replicas.{name} must be an int >= {low}, got {value!r}")


@dataclass
class _CombineState:
    output: torch.Tensor
    plan: comm.DispatchPlan
    received: comm.Received
    combine_weights: torch.Tensor


class AllToAllPrepareFinalize:
    """The portable kernels' `PrepareFinalize` (CPU with gloo, CUDA with NCCL).

    Args:
        recipe: the format: how a token row is quantized for the wire and dequantized.
        runtime: the process group, this rank and the device.
        num_local_experts: experts (slots) per rank (rank r owns `[r*E_local, (r+1)*E_local)`,
            or under `placement` its slots).
        hidden_size: H.
        dedup: send a token once per destination rank (not once per slot routed there).
        topk_weight_before_fc2: send each pair's top-k weight with it (`Dispatched.pair_scale`)
            and sum the expert outputs unweighted.
        placement: where the logical experts' slots are (None: contiguous,
            `num_local_experts` per rank); its slots per rank must be `num_local_experts`.
        replicas: how a replicated expert's pairs are spread; given when (and only when)
            `placement` has replicas.
    """

    def __init__(
        self,
        recipe: Recipe,
        runtime: KernelRuntime,
        *,
        num_local_experts: int,
        hidden_size: int,
        dedup: bool = True,
        topk_weight_before_fc2: bool = False,
        placement: Placement | None = None,
        replicas: Replicas | None = None,
    ) -> None:
        check_recipe(recipe)
        for name, value in (("num_local_experts", num_local_experts), ("hidden_size", hidden_size)):
            if type(value) is not int or value < 1:
                raise MoeEpUsageError(f"{name} must be an int >= 1, got {value!r}")
        if hidden_size % recipe.k_multiple:
            raise MoeEpUsageError(
                f"hidden_size must be a multiple of {recipe.k_multiple} for format "
                f"{recipe.name}, got {hidden_size}"
            )
        check_bool("dedup", dedup)
        check_bool("topk_weight_before_fc2", topk_weight_before_fc2)
        self.recipe = recipe
        self.runtime = runtime
        self.num_local_experts = num_local_experts
        self.hidden_size = hidden_size
        self.dedup = dedup
        self.topk_weight_before_fc2 = topk_weight_before_fc2
        self.workspace = comm.Workspace()
        self.keeps_codes = recipe.keeps_codes(runtime.device)
        """The received rows' codes go to the experts (`Dispatched.codes`): the rows are
        packed (at world size 1 also dequantized in one pass, `_Staged.rows`)."""
        self.placement = self._check_placement(placement, runtime.world_size)
        replicated = self.placement is not None and self.placement.replicated
        if replicated != (replicas is not None) or not isinstance(replicas, Replicas | None):
            raise MoeEpUsageError(
                "replicas=Replicas(spread_rows, row_block) is needed with, and only with, a "
                f"placement that has replicas: got replicas={replicas!r} for placement="
                f"{self.placement!r}"
            )
        self.replicas = replicas
        self._table = (
            None if self.placement is None else replica_table(self.placement, runtime.device)
        )

    def _check_placement(self, placement: Placement | None, world_size: int) -> Placement | None:
        if placement is None or (isinstance(placement, Placement) and placement.is_contiguous):
            return None
        if not isinstance(placement, Placement):
            raise MoeEpUsageError(
                "placement must be a moe_ep.placement.Placement or None, got "
                f"{type(placement).__name__}"
            )
        if (placement.world_size, placement.slots_per_rank) != (world_size, self.num_local_experts):
            raise MoeEpUsageError(
                f"placement must have world_size={world_size} and slots_per_rank="
                f"num_local_experts={self.num_local_experts}, got {placement!r}"
            )
        return placement

    def stage(self, tensors: MoEEpTensors, output: torch.Tensor) -> _Staged:
        """Plan the routing and quantize the rows to send (local); under replicas quantize
        every token's row and leave the plan to `prepare` (it needs the gathered counts)."""
        ids = tensors.topk_ids
        if self.placement is not None and self.placement.replicated:
            payload = self.recipe.pack(tensors.hidden_states)  # per-row: same bytes
            return _Staged(output, None, payload, tensors.topk_weights, ids)
        if self._table is not None:
            ids = route_to_slots(
                ids, self._table, rank_counts=None, rank=0, spread_rows=0, row_block=1
            )
        plan = comm.plan_dispatch(ids, self.num_local_experts, self.runtime.world_size, self.dedup)
        rows = tensors.hidden_states.index_select(0, plan.row_token)
        here = self.recipe.pack_unpack(rows) if self.runtime.world_size == 1 else None
        if here is not None and not self.keeps_codes:
            return _Staged(output, plan, here, tensors.topk_weights, dequantized=True)
        return _Staged(output, plan, self.recipe.pack(rows), tensors.topk_weights, rows=here)

    def _plan_replicated(self, staged: _Staged) -> tuple[comm.DispatchPlan, list[int]]:
        """Collective: gather the per-expert pair counts, route, plan; the experts' path rows."""
        rt, placement, reps = self.runtime, self.placement, self.replicas
        assert placement is not None and reps is not None and self._table is not None
        assert staged.topk_ids is not None
        mine = expert_pair_counts(staged.topk_ids, placement.num_experts)
        counts = _gather_counts(mine, rt.group, rt.rank, rt.world_size)
        ids = route_to_slots(
            staged.topk_ids,
            self._table,
            rank_counts=counts,
            rank=rt.rank,
            spread_rows=reps.spread_rows,
            row_block=reps.row_block,
        )
        plan = comm.plan_dispatch(ids, self.num_local_experts, rt.world_size, self.dedup)
        staged.payload = staged.payload.index_select(0, plan.row_token)
        total = counts.sum(0).tolist()
        return plan, [total[e] for e in placement.rank_slots(rt.rank)]

    def prepare(self, staged: _Staged) -> tuple[Dispatched, _CombineState]:
        """Counts, payload rows and pair metadata to their ranks; dequantize on arrival."""
        rt, plan, path_rows = self.runtime, staged.plan, None
        if plan is None:
            plan, path_rows = self._plan_replicated(staged)
        w = staged.topk_weights
        pair_weight = (
            w[plan.pair_token, plan.pair_slot].float() if self.topk_weight_before_fc2 else None
        )
        recv = comm.exchange(
            plan,
            staged.payload,
            group=rt.group,
            rank=rt.rank,
            world_size=rt.world_size,
            workspace=self.workspace,
            pair_weight=pair_weight,
        )
        staged.payload = staged.payload[:0]  # the send buffer is no longer needed
        if staged.rows is not None:  # world size 1: the payload's rows, in order
            rows = staged.rows
        elif staged.dequantized:
            rows = recv.rows
        else:
            rows = self.recipe.unpack(recv.rows, self.hidden_size)
        codes = self.recipe.codes_of(recv.rows, self.hidden_size) if self.keeps_codes else None
        recv.rows = recv.rows[:0]  # dequantized (or viewed by codes): no longer needed here
        # weights already applied before FC2: the top-k sum adds the rows as they are
        combine_w = torch.ones_like(w) if self.topk_weight_before_fc2 else w
        dispatched = Dispatched(
            rows, recv.pair_row, recv.pair_expert, recv.pair_weight, path_rows, codes
        )
        return dispatched, _CombineState(staged.output, plan, recv, combine_w)

    def _return_rows(self, expert_out: torch.Tensor, state: _CombineState) -> torch.Tensor:
        rt = self.runtime
        return comm.return_rows(
            expert_out,
            state.received,
            state.plan,
            group=rt.group,
            rank=rt.rank,
            workspace=self.workspace,
        )

    def finalize(self, expert_out: torch.Tensor, state: _CombineState) -> torch.Tensor:
        """Each pair's row back to its home rank, then the fp32 top-k sum into the output."""
        y_home = self._return_rows(expert_out, state)
        return comm.combine(
            y_home, state.plan, state.combine_weights, state.output, workspace=self.workspace
        )

    def finalize_unreduced(
        self, expert_out: torch.Tensor, state: _CombineState
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each pair's row back to its home rank, laid out (token, slot) with an identity
        route map (`PrepareFinalize.finalize_unreduced`)."""
        y_home = self._return_rows(expert_out, state)
        return comm.unreduced(y_home, state.plan, state.combine_weights)

    def clear(self) -> None:
        """Drop the receive buffers (idempotent)."""
        self.workspace.clear()


def _gather_counts(mine: torch.Tensor, group: object, rank: int, world_size: int) -> torch.Tensor:
    """`[W, E]` int64: every rank's `[E]` counts, in rank order (one bounded all-gather)."""
    if world_size == 1:
        return mine[None]
    parts = [torch.empty_like(mine) for _ in range(world_size)]
    pg: Any = group
    post_and_wait(
        group,
        lambda: dist.all_gather(parts, mine, group=pg, async_op=True),
        what="moe-ep forward (dispatch: per-expert counts)",
        rank=rank,
    )
    return torch.stack(parts)

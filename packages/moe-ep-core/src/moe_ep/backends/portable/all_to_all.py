"""`AllToAllPrepareFinalize`: the portable dispatch and combine over a process group.

Quantize each token on its home rank with the format's recipe, send it to the ranks owning
its experts with uneven `all_to_all_single`s (`comm`), dequantize on arrival; the finalize
returns one row per pair the same way and sums them on the home rank. On a group of one rank
the same path runs with no collective and no copy (`comm`: an all-to-all of one rank hands
its rows on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.backends.portable import comm
from moe_ep.backends.portable.configs import check_bool
from moe_ep.backends.portable.prepare_finalize import Dispatched
from moe_ep.backends.portable.recipes import Recipe, check_recipe
from moe_ep.contract import KernelRuntime
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import MoEEpTensors

__all__ = ["AllToAllPrepareFinalize"]


@dataclass
class _Staged:
    output: torch.Tensor
    plan: comm.DispatchPlan
    payload: torch.Tensor
    topk_weights: torch.Tensor


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
        num_local_experts: experts per rank (rank r owns `[r*E_local, (r+1)*E_local)`).
        hidden_size: H.
        dedup: send a token once per destination rank (not once per slot routed there).
        topk_weight_before_fc2: send each pair's top-k weight with it (`Dispatched.pair_scale`)
            and sum the expert outputs unweighted.
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

    def stage(self, tensors: MoEEpTensors, output: torch.Tensor) -> _Staged:
        """Plan the routing and quantize the rows to send (local)."""
        plan = comm.plan_dispatch(
            tensors.topk_ids, self.num_local_experts, self.runtime.world_size, self.dedup
        )
        payload = self.recipe.pack(tensors.hidden_states.index_select(0, plan.row_token))
        return _Staged(output, plan, payload, tensors.topk_weights)

    def prepare(self, staged: _Staged) -> tuple[Dispatched, _CombineState]:
        """Counts, payload rows and pair metadata to their ranks; dequantize on arrival."""
        rt, plan = self.runtime, staged.plan
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
        rows = self.recipe.unpack(recv.rows, self.hidden_size)
        recv.rows = recv.rows[:0]  # dequantized: the received bytes are no longer needed
        # weights already applied before FC2: the top-k sum adds the rows as they are
        combine_w = torch.ones_like(w) if self.topk_weight_before_fc2 else w
        dispatched = Dispatched(rows, recv.pair_row, recv.pair_expert, recv.pair_weight)
        return dispatched, _CombineState(staged.output, plan, recv, combine_w)

    def finalize(self, expert_out: torch.Tensor, state: _CombineState) -> torch.Tensor:
        """Each pair's row back to its home rank, then the fp32 top-k sum into the output."""
        rt = self.runtime
        y_home = comm.return_rows(
            expert_out,
            state.received,
            state.plan,
            group=rt.group,
            rank=rt.rank,
            workspace=self.workspace,
        )
        return comm.combine(
            y_home, state.plan, state.combine_weights, state.output, workspace=self.workspace
        )

    def clear(self) -> None:
        """Drop the receive buffers (idempotent)."""
        self.workspace.clear()

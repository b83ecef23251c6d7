"""The prepare/finalize part of the portable seam: quantize + dispatch, and combine.

As vLLM's fused-MoE modular kernel splits a MoE into a prepare/finalize part and an experts
part, a portable kernel is one `PrepareFinalize` (this module) paired with one `Experts`
(`experts_protocol`) by `modular.ModularKernel`. What passes between them is a `Dispatched`
record and, back, one expert output row per dispatched pair: nothing else, so either side
can be swapped (e.g. an NCCL all-to-all with the portable experts, or the portable dispatch
with another experts implementation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moe_ep.backends.portable.cpu_fused import E4m3Rows
from moe_ep.types import MoEEpTensors

__all__ = ["Dispatched", "PrepareFinalize"]


@dataclass
class Dispatched:
    """This rank's share of one forward, as the experts part receives it.

    rows: `[R, H]` the received token rows, dequantized (the recipe's compute dtype).
    pair_row: `[P]` int64, the row of `rows` of each (token, slot) pair routed here.
    pair_expert: `[P]` int64, its local expert (`0 <= e < E_local`).
    pair_scale: `[P]` fp32, the pair's top-k weight when it is applied before FC2 (the
        experts multiply the SwiGLU output by it before the FC2 input is quantized, and
        the finalize sums the outputs unweighted); None: the finalize weights them.
    path_rows: per local expert, the row count that picks how the experts compute it
        (under a placement with replicas: its logical expert's pairs over all ranks, so a
        replica holding part of them computes them as the whole would be); None: the
        expert's own pair count here.
    codes: the rows as e4m3 codes and fp32 scales (views of the received payload) where the
        recipe keeps them for the experts' block-scaled order (`Recipe.keeps_codes`: fp8 on
        a CPU with AMX); None otherwise.

    Pairs of one expert come in global (token, slot) order (the order the bit-identity
    across world sizes rests on).
    """

    rows: torch.Tensor
    pair_row: torch.Tensor
    pair_expert: torch.Tensor
    pair_scale: torch.Tensor | None = None
    path_rows: list[int] | None = None
    codes: E4m3Rows | None = None


class PrepareFinalize(Protocol):
    """Quantize and dispatch a rank's tokens to the ranks owning their experts, and bring
    the expert outputs home and sum them.

    `stage` is local (no collective: the layer runs it in `stage_inputs`); `prepare` and
    `finalize` are collective. The staged handle and the combine state are opaque to
    everyone but the implementation that made them.
    """

    def stage(self, tensors: MoEEpTensors, output: torch.Tensor) -> Any:
        """Plan the routing and quantize this rank's tokens (local); a handle for `prepare`."""
        ...

    def prepare(self, staged: Any) -> tuple[Dispatched, Any]:
        """Dispatch: the rows and pairs routed to this rank's experts, and the state
        `finalize` needs."""
        ...

    def finalize(self, expert_out: torch.Tensor, state: Any) -> torch.Tensor:
        """`expert_out [P, H]` bf16, one row per dispatched pair in `Dispatched` order ->
        the staged output `[n, H]` bf16 (`sum_k w_k * y_k` per token, fp32, slot order)."""
        ...

    def finalize_unreduced(
        self, expert_out: torch.Tensor, state: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`finalize` without the top-k sum: each pair's row brought home, as `(rows
        [n*k, H] bf16, weights [n, k] fp32, route_map [n, k] int32)`; row `route_map[t, j]`
        is slot j of token t, `weights[t, j]` the weight the host still applies (1 when it
        was applied before FC2); a padded slot has a zero row and weight 0."""
        ...

    def clear(self) -> None:
        """Drop the buffers kept across forwards (idempotent, local)."""
        ...

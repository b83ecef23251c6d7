"""The capture-safe bf16 forward: fixed-capacity dispatch, device-only routing.

Opt in with `capture_safe=True` on `Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig`. No step reads a
device value on the host (no `.item()`, `.tolist()`, `nonzero`, `bincount`), so a warmed
forward can be captured in a CUDA graph:

- Dispatch: every rank sends `C` slots to every rank, `C = max_tokens_per_rank` with dedup
  (one slot per (destination, token)) or `max_tokens_per_rank * k` without (one per pair),
  so both `all_to_all_single`s have equal splits fixed at construction. A slot carries its
  token row and, per top-k slot of the token, the local expert (-1: not for that rank) and
  the top-k weight. Empty slots carry a zero row and -1 everywhere.
- Invalid pairs (id -1, rows at or past `num_valid_tokens_tensor`) are masked on device.
  Ids outside `[-1, E)` are masked too: an eager `MoEEpLayer` forward refuses them before
  this runs, but a forward under capture (whose checks read no device value) and a direct
  caller of the kernel get them routed nowhere, as id -1. A count below 0 leaves no row
  live, one above n every row.
- Output rows at or past the count keep the values they held (they are copied back over
  themselves), so a caller's buffer keeps them and the layer's own, zeroed, stays zero.
- Experts: a device stable sort by local expert (invalid pairs last) and two
  `torch._grouped_mm` with device int32 end offsets; rows past the last offset are not
  computed and are zeroed before the combine.
- Combine: the rows come back in slot order (equal splits again) and the home rank sums
  `w * y` in fp32 in slot order, padded slots adding exactly +0 (`cpu_fused.combine` on CPU).

Cost against the default path: both all-to-alls move `W * C` slots whatever the routing, and
the gather and SwiGLU run on all `W * C * S` received pair rows (S = k with dedup, else 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_ep.backends.portable import comm, cpu_fused
from moe_ep.backends.portable.experts import _swiglu, unsort_rows
from moe_ep.backends.portable.recipes import PreparedWeights
from moe_ep.contract import KernelRuntime
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import MoEEpTensors

__all__ = ["CaptureSafeForward"]


@dataclass
class _Staged:
    output: torch.Tensor
    send_x: torch.Tensor
    """`[W * C, H]` bf16: the slots to send, destination-major."""
    send_meta: torch.Tensor
    """`[W * C, 2 * S]` int32: per sub-slot the local expert (-1: none), then the fp32
    weight bits."""
    home_row: torch.Tensor
    """`[n, k]` int64: the row of the returned `[W * C * S, H]` rows holding pair (t, j), -1
    for an invalid pair."""
    weights: torch.Tensor
    """`[n, k]` fp32 top-k weights the combine applies (ones when applied before FC2)."""
    live: torch.Tensor | None
    """`[n, 1]` bool: rows below the live count (None: every row)."""


class CaptureSafeForward:
    """Stage and compute one bf16 forward with no host synchronisation.

    Args:
        runtime: the group, rank and device.
        num_experts / num_local_experts / hidden_size / max_tokens: the fleet's.
        dedup: one slot per (destination, token) rather than per pair.
        before_fc2: apply the top-k weight to the SwiGLU output (sum unweighted).
        swiglu_clamp: as `TorchExperts`.
    """

    def __init__(
        self,
        runtime: KernelRuntime,
        *,
        num_experts: int,
        num_local_experts: int,
        hidden_size: int,
        max_tokens: int,
        dedup: bool,
        before_fc2: bool,
        swiglu_clamp: float | None,
    ) -> None:
        self.runtime = runtime
        self.num_experts = num_experts
        self.e_local = num_local_experts
        self.hidden = hidden_size
        self.max_tokens = max_tokens
        self.dedup = dedup
        self.before_fc2 = before_fc2
        self.swiglu_clamp = swiglu_clamp
        self.workspace = comm.Workspace()

    def capacity(self, k: int) -> int:
        """Slots per destination rank for top-k `k`."""
        return self.max_tokens if self.dedup else self.max_tokens * k

    def stage(self, tensors: MoEEpTensors, output: torch.Tensor) -> _Staged:
        """Route on device and fill the fixed-capacity send slots (local)."""
        x, ids, w = tensors.hidden_states, tensors.topk_ids, tensors.topk_weights.float()
        n, k = int(ids.shape[0]), int(ids.shape[1])
        if n > self.max_tokens:  # more would overflow into the next destination's slots
            raise MoeEpUsageError(
                f"hidden_states has n = {n} rows, more than max_tokens_per_rank = "
                f"{self.max_tokens} (the capture-safe dispatch's capacity)"
            )
        world, dev = self.runtime.world_size, x.device
        c = self.capacity(k)
        units, sub = (n, k) if self.dedup else (n * k, 1)
        ids = ids.long()
        valid = (ids >= 0) & (ids < self.num_experts)
        live = None
        if tensors.num_valid_tokens_tensor is not None:
            live_t = tensors.num_valid_tokens_tensor.to(torch.int64)
            live = (torch.arange(n, device=dev) < live_t)[:, None]
            valid &= live
        dest = torch.where(valid, torch.div(ids, self.e_local, rounding_mode="floor"), -1)
        local = ids - dest * self.e_local
        u_dest = dest.reshape(units, sub)
        u_local = local.reshape(units, sub)
        u_w = w.reshape(units, sub)
        ranks = torch.arange(world, device=dev)
        to_rank = u_dest[:, None, :] == ranks[None, :, None]  # [U, W, S]
        has = to_rank.any(dim=2)  # [U, W]
        pos = torch.cumsum(has.long(), 0) - 1  # slot within its destination, (token, slot) order
        slot = torch.where(has, ranks[None, :] * c + pos, world * c)  # world * c: the dump slot
        token = torch.arange(units, device=dev) // (k // sub)
        slot_token = torch.full((world * c + 1,), n, dtype=torch.int64, device=dev)
        slot_token.scatter_(0, slot.reshape(-1), token[:, None].expand(units, world).reshape(-1))
        x_ext = torch.cat([x, x.new_zeros((1, self.hidden))])  # row n: an empty slot's zeros
        send_x = x_ext.index_select(0, slot_token[: world * c])
        meta_e = torch.where(to_rank, u_local[:, None, :], -1).to(torch.int32)
        meta_w = torch.where(to_rank, u_w[:, None, :], 0.0).contiguous().view(torch.int32)
        meta = torch.cat([meta_e, meta_w], dim=2).reshape(units * world, 2 * sub)
        send_meta = torch.full((world * c + 1, 2 * sub), -1, dtype=torch.int32, device=dev)
        send_meta.index_put_((slot.reshape(-1),), meta)
        # pair (t, j) comes home at row (d * c + pos[u, d]) * sub + s of the returned rows
        d_safe = u_dest.clamp(min=0)
        u_pos = pos.gather(1, d_safe)  # [U, S]
        s_idx = torch.arange(sub, device=dev)[None, :] if sub > 1 else torch.zeros_like(u_pos)
        row = (d_safe * c + u_pos) * sub + s_idx
        home_row = torch.where(u_dest >= 0, row, -1).reshape(n, k)
        combine_w = torch.ones_like(w) if self.before_fc2 else w
        return _Staged(output, send_x, send_meta[: world * c], home_row, combine_w, live)

    def _a2a(self, send: torch.Tensor, name: str, what: str) -> torch.Tensor:
        rt = self.runtime
        if rt.world_size == 1:
            return send
        out = self.workspace.get(name, tuple(send.shape), send.dtype, send.device)
        splits = [int(send.shape[0]) // rt.world_size] * rt.world_size
        return comm._a2a(out, send, splits, splits, rt.group, what, rt.rank)

    def compute(self, staged: _Staged, weights: PreparedWeights) -> torch.Tensor:
        """Collective: dispatch, the experts, combine into the staged output."""
        dev, h = staged.send_x.device, self.hidden
        recv_x = self._a2a(staged.send_x.view(torch.uint8), "cs_x", "dispatch payload")
        recv_meta = self._a2a(staged.send_meta, "cs_meta", "dispatch metadata")
        recv_x = recv_x.view(torch.bfloat16)
        sub = int(recv_meta.shape[1]) // 2
        expert = recv_meta[:, :sub].reshape(-1).long()  # [P], P = W * C * S
        valid = expert >= 0
        key = torch.where(valid, expert, self.e_local)
        order = torch.sort(key, stable=True).indices
        sorted_key = key[order]
        bounds = torch.arange(1, self.e_local + 1, device=dev)
        offs = torch.searchsorted(sorted_key, bounds).to(torch.int32)
        xs = recv_x.index_select(0, torch.div(order, sub, rounding_mode="floor"))
        assert weights.w13t is not None and weights.w2t is not None  # never packed (configs)
        gu = torch._grouped_mm(xs, weights.w13t, offs=offs)
        hh = self.workspace.get("cs_h", (int(gu.shape[0]), int(gu.shape[1]) // 2), gu.dtype, dev)
        scale = None
        if self.before_fc2:
            scale = recv_meta[:, sub:].contiguous().view(torch.float32).reshape(-1)[order]
        _swiglu(gu, hh, None, self.swiglu_clamp, None, self.workspace, scale)
        y_sorted = torch._grouped_mm(hh, weights.w2t, offs=offs)
        y_sorted = torch.where(valid[order][:, None], y_sorted, 0)  # rows never computed
        y = unsort_rows(y_sorted, order, torch.empty_like(y_sorted))
        y_home = self._a2a(y.view(torch.uint8).view(-1, sub * 2 * h), "cs_y", "combine")
        y_home = y_home.view(torch.bfloat16).reshape(-1, h)
        return self._combine(y_home, staged)

    def _combine(self, y_home: torch.Tensor, staged: _Staged) -> torch.Tensor:
        out, pos, w = staged.output, staged.home_row, staged.weights
        n, k = int(pos.shape[0]), int(pos.shape[1])
        if n == 0:
            return out
        res = (
            out
            if staged.live is None
            else self.workspace.get("cs_out", tuple(out.shape), out.dtype, out.device)
        )
        if not cpu_fused.combine(y_home, pos, w, res):
            rows = y_home.index_select(0, pos.reshape(-1).clamp(min=0)).view(n, k, -1).float()
            terms = torch.where((pos >= 0)[:, :, None], rows * w[:, :, None], 0.0)
            acc = terms[:, 0].clone()
            for j in range(1, k):
                acc.add_(terms[:, j])
            res.copy_(acc)
        if staged.live is not None:  # rows past the live count keep what they held
            out.copy_(torch.where(staged.live, res, out))
        return out

    def clear(self) -> None:
        """Drop the buffers (idempotent)."""
        self.workspace.clear()

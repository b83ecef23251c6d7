"""Dispatch and combine over `torch.distributed` (`all_to_all_single`, uneven splits).

Send order on the home rank is (destination rank, token, slot); every destination receives
its pairs in (source rank, token, slot) order and regroups them by local expert with a stable
sort, so an expert always sees its rows in global (token, slot) order whatever the world size.
The combine returns one row per (token, slot) and sums on the home rank in slot order.
A group of one rank runs the same steps with no collective: its all-to-all hands the rows on
as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from moe_ep.backends.portable import cpu_fused
from moe_ep.runtime import post_and_wait

__all__ = [
    "COMBINE_BYTES",
    "DispatchPlan",
    "Received",
    "Workspace",
    "combine",
    "exchange",
    "plan_dispatch",
    "return_rows",
    "unreduced",
]


class Workspace:
    """Receive buffers reused across forwards (grown on demand, never shrunk).

    Fresh buffers each forward would pay a page fault per 4 KiB on first touch, which on
    CPU costs as much as the transfer itself.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._subs: dict[str, Workspace] = {}
        # the last view handed out per name: a forward of the same shape takes it as it is
        # (keyed on inference mode too: a view made under it cannot be written outside it)
        self._views: dict[str, tuple[object, torch.Tensor]] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised `[*shape]` tensor; valid until the next `get` of `name`."""
        key = (tuple(shape), dtype, device, torch.is_inference_mode_enabled())
        last = self._views.get(name)
        if last is not None and last[0] == key:
            return last[1]
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            self._bufs[name] = buf
        view = buf[:nbytes].view(dtype).view(shape)
        self._views[name] = (key, view)
        return view

    def sub(self, name: str) -> Workspace:
        """A nested workspace kept under `name` (e.g. one per worker thread)."""
        sub = self._subs.get(name)
        if sub is None:
            sub = self._subs[name] = Workspace()
        return sub

    def clear(self) -> None:
        self._bufs.clear()
        self._subs.clear()
        self._views.clear()


@dataclass
class DispatchPlan:
    """Home-side routing of one forward.

    pair_token / pair_slot: `[P]` int64 token and slot of each valid pair, in send order.
    row_token: `[R]` int64 token of each payload row sent, in send order (R == P without
        dedup; one row per (destination, token) with dedup).
    pair_meta: `[P, 2]` int32 (row index within its destination's chunk, local expert).
    row_counts / pair_counts: per destination rank.
    """

    pair_token: torch.Tensor
    pair_slot: torch.Tensor
    row_token: torch.Tensor
    pair_meta: torch.Tensor
    row_counts: list[int]
    pair_counts: list[int]


def plan_dispatch(
    topk_ids: torch.Tensor, e_local: int, world_size: int, dedup: bool
) -> DispatchPlan:
    """Plan the dispatch of `topk_ids [n, k]` (-1 = padded) over `world_size` ranks."""
    n, k = int(topk_ids.shape[0]), int(topk_ids.shape[1])
    flat = topk_ids.reshape(-1).long()
    idx = (flat >= 0).nonzero().squeeze(1)  # token-major: (token, slot) order
    if world_size == 1:
        return _plan_one_rank(flat, idx, n, k, dedup)
    dest = torch.div(flat[idx], e_local, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    idx, dest = idx[order], dest[order]
    pair_token = torch.div(idx, k, rounding_mode="floor")
    pair_slot = idx - pair_token * k
    local_expert = flat[idx] - dest * e_local
    pair_counts_t = torch.bincount(dest, minlength=world_size)
    if dedup and idx.numel():
        key = dest * max(n, 1) + pair_token
        new_row = torch.ones_like(key, dtype=torch.bool)
        new_row[1:] = key[1:] != key[:-1]
        row_of_pair = torch.cumsum(new_row.long(), 0) - 1
        first = new_row.nonzero().squeeze(1)
        row_token = pair_token[first]
        row_counts_t = torch.bincount(dest[first], minlength=world_size)
    else:
        row_of_pair = torch.arange(idx.numel(), device=flat.device)
        row_token = pair_token
        row_counts_t = pair_counts_t
    row_start = torch.cumsum(row_counts_t, 0) - row_counts_t
    row_in_chunk = row_of_pair - row_start[dest]
    meta = torch.stack([row_in_chunk, local_expert], dim=1).to(torch.int32)
    return DispatchPlan(
        pair_token=pair_token,
        pair_slot=pair_slot,
        row_token=row_token,
        pair_meta=meta,
        row_counts=row_counts_t.tolist(),
        pair_counts=pair_counts_t.tolist(),
    )


def _plan_one_rank(
    flat: torch.Tensor, idx: torch.Tensor, n: int, k: int, dedup: bool
) -> DispatchPlan:
    """`plan_dispatch` on a group of one rank, in fewer (small, per-forward) ops: every pair
    stays in (token, slot) order, its local expert is its id; with dedup one row per token
    that has a valid slot (with no padded slot: every token, in order)."""
    pairs = int(idx.numel())
    pair_token = torch.div(idx, k, rounding_mode="floor")
    if not dedup:
        row_of_pair, row_token = torch.arange(pairs, device=flat.device), pair_token
    elif k and pairs == n * k:
        row_of_pair, row_token = pair_token, torch.arange(n, device=flat.device)
    else:
        row_token, row_of_pair = torch.unique_consecutive(pair_token, return_inverse=True)
    meta = torch.stack([row_of_pair, flat[idx]], dim=1).to(torch.int32)
    return DispatchPlan(
        pair_token=pair_token,
        pair_slot=idx - pair_token * k,
        row_token=row_token,
        pair_meta=meta,
        row_counts=[int(row_token.numel())],
        pair_counts=[pairs],
    )


@dataclass
class Received:
    """Destination-side view: payload rows and, per received pair, its row and local expert.

    rows: `[R_recv, B]` uint8 payload. pair_row: `[P_recv]` int64 index into rows.
    pair_expert: `[P_recv]` int64 local expert. pair_counts: pairs received per source.
    """

    rows: torch.Tensor
    pair_row: torch.Tensor
    pair_expert: torch.Tensor
    pair_counts: list[int]
    pair_weight: torch.Tensor | None = None
    """`[P_recv]` fp32 top-k weight of each received pair, when sent."""


def _a2a(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: object,
    what: str,
    rank: int,
) -> torch.Tensor:
    """One uneven `all_to_all_single`, waited for within the runtime's timeout; returns the
    received rows: `out`, or on a group of one rank (one split) `inp` itself, as the rows
    are already here (no collective, no copy).

    A failure while posting is this rank's own (it is re-raised as it is, after telling
    the peers waiting for this rank through the fault board); a failure of the collective
    itself, or a peer's report, raises the verdict every survivor raises (`MoeEpPeerError`
    / `MoeEpTimeoutError` naming the failed ranks).
    """
    if len(in_splits) == 1:
        return inp
    pg: Any = group
    post_and_wait(
        group,
        lambda: dist.all_to_all_single(out, inp, out_splits, in_splits, group=pg, async_op=True),
        what=f"moe-ep forward ({what})",
        rank=rank,
    )
    return out


def exchange(
    plan: DispatchPlan,
    payload: torch.Tensor,
    *,
    group: object,
    rank: int,
    world_size: int,
    workspace: Workspace | None = None,
    pair_weight: torch.Tensor | None = None,
) -> Received:
    """Counts exchange, then payload rows and pair metadata (three `all_to_all_single`s).

    pair_weight: `[P]` fp32 per pair (send order), sent as a third metadata column.
    """
    dev = payload.device
    if world_size == 1:  # the rows stay: no collective, no copy
        weight = None if pair_weight is None else pair_weight.to(torch.float32).contiguous()
        meta = plan.pair_meta
        pairs = list(plan.pair_counts)
        return Received(payload, meta[:, 0].long(), meta[:, 1].long(), pairs, weight)
    counts = torch.tensor([plan.row_counts, plan.pair_counts], dtype=torch.int64).t().contiguous()
    recv_counts = torch.empty_like(counts)
    counts, recv_counts = counts.to(dev), recv_counts.to(dev)
    recv_counts = _a2a(
        recv_counts, counts, [1] * world_size, [1] * world_size, group, "dispatch counts", rank
    )
    rc = recv_counts.cpu()
    recv_rows_n, recv_pairs_n = rc[:, 0].tolist(), rc[:, 1].tolist()
    ws_ = workspace or Workspace()
    rows = ws_.get("recv_rows", (sum(recv_rows_n), int(payload.shape[1])), payload.dtype, dev)
    rows = _a2a(rows, payload, recv_rows_n, plan.row_counts, group, "dispatch payload", rank)
    send_meta = plan.pair_meta
    if pair_weight is not None:  # fp32 bits ride along as int32
        bits = pair_weight.to(torch.float32).contiguous().view(torch.int32)
        send_meta = torch.cat([send_meta, bits[:, None]], dim=1)
    meta = send_meta.new_empty((sum(recv_pairs_n), int(send_meta.shape[1])))
    meta = _a2a(meta, send_meta, recv_pairs_n, plan.pair_counts, group, "dispatch metadata", rank)
    src = torch.repeat_interleave(
        torch.arange(world_size, device=dev), torch.tensor(recv_pairs_n, device=dev)
    )
    row_start = torch.cumsum(rc[:, 0], 0) - rc[:, 0]
    pair_row = meta[:, 0].long() + row_start.to(dev)[src]
    weight = None if pair_weight is None else meta[:, 2].contiguous().view(torch.float32)
    return Received(rows, pair_row, meta[:, 1].long(), recv_pairs_n, weight)


def return_rows(
    y: torch.Tensor,
    recv: Received,
    plan: DispatchPlan,
    *,
    group: object,
    rank: int,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Send `y [P_recv, H]` (received pair order) back; returns `[P, H]` in send order."""
    shape = (sum(plan.pair_counts), int(y.shape[1]))
    out = (workspace or Workspace()).get("returned", shape, y.dtype, y.device)
    returned = _a2a(
        out.view(torch.uint8),
        y.contiguous().view(torch.uint8),
        plan.pair_counts,
        recv.pair_counts,
        group,
        "combine",
        rank,
    )
    return returned.view(y.dtype)


COMBINE_BYTES = 1 << 20
"""fp32 bytes of one token slice of the combine (`[c, k, H]`): stays in L2."""


def combine(
    y_home: torch.Tensor,
    plan: DispatchPlan,
    topk_weights: torch.Tensor,
    output: torch.Tensor,
    *,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """`output[t] = bf16(sum_j w[t, j] * y[t, j])`, fp32, slots in increasing order.

    `y_home [P, H]` holds pair p's row at `p` (send order).
    Padded slots have no pair: their term is exactly +0 and reads no row (so an inf / NaN
    in another token's row stays there); a token with no valid slot gets exact zeros.

    bf16 on CPU goes through `cpu_fused.combine` (one pass, same bits) when its library is
    available. Otherwise works on slices of `c` tokens: gather their `c * k` rows, widen to
    fp32, scale by the weights, add the slots in order, round into the output; the slice
    stays in cache. Every step is exact per element (copy, one fp32 product, fp32 adds in
    slot order, RNE), so a token's result does not depend on the slicing (i.e. on how many
    tokens the rank holds).
    """
    n, k = int(topk_weights.shape[0]), int(topk_weights.shape[1])
    dev = output.device
    if y_home.shape[0] == 0 or n == 0:
        return output.zero_()
    pos = torch.full((n, k), -1, dtype=torch.int64, device=dev)  # -1: padded, reads no row
    pos[plan.pair_token, plan.pair_slot] = torch.arange(int(plan.pair_token.numel()), device=dev)
    if not cpu_fused.combine(y_home, pos, topk_weights, output):
        _combine_eager(y_home, pos, topk_weights.unsqueeze(2), output, workspace or Workspace())
    return output


def unreduced(
    y_home: torch.Tensor, plan: DispatchPlan, topk_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`combine`'s inputs without its sum: `(rows [n*k, H], weights [n, k] fp32, route_map
    [n, k] int32)`, row `t*k + j` holding pair (t, j) (the identity route map); a padded
    slot gets a zero row and weight 0, so the host's sum adds exactly +0 for it."""
    n, k = int(topk_weights.shape[0]), int(topk_weights.shape[1])
    dev = topk_weights.device
    flat = plan.pair_token * k + plan.pair_slot
    rows = y_home.new_zeros((n * k, int(y_home.shape[1])))
    rows[flat] = y_home
    weights = torch.zeros(n * k, dtype=torch.float32, device=dev)
    weights[flat] = topk_weights.reshape(-1)[flat].float()
    route_map = torch.arange(n * k, dtype=torch.int32, device=dev).view(n, k)
    return rows, weights.view(n, k), route_map


def _combine_eager(
    y_home: torch.Tensor, pos: torch.Tensor, w: torch.Tensor, output: torch.Tensor, wsp: Workspace
) -> None:
    """`combine`'s sum in torch ops, on cache-sized token slices (`w` is `[n, k, 1]`)."""
    n, k = int(pos.shape[0]), int(pos.shape[1])
    dev = output.device
    hidden = int(output.shape[1])
    c = max(1, min(n, COMBINE_BYTES // (4 * k * hidden)))
    gathered = wsp.get("combine_rows", (c * k, hidden), y_home.dtype, dev)
    terms = wsp.get("combine_terms", (c, k, hidden), torch.float32, dev)
    acc = wsp.get("combine_acc", (c, hidden), torch.float32, dev)
    for t0 in range(0, n, c):
        m = min(c, n - t0)
        pm = pos[t0 : t0 + m]
        g = torch.index_select(y_home, 0, pm.reshape(-1).clamp(min=0), out=gathered[: m * k])
        tm, am, om = terms[:m], acc[:m], output[t0 : t0 + m]
        tm.view(m * k, hidden).copy_(g)
        tm.mul_(w[t0 : t0 + m])
        tm.masked_fill_(pm.unsqueeze(2) < 0, 0.0)  # padded slots: +0 whatever row 0 holds
        if k == 1:
            om.copy_(tm[:, 0])
            continue
        # fp32 sum in slot order, rounded once (RNE) into the bf16 output by copy_ (an add
        # with a bf16 `out` measured slower than the fp32 add plus the rounding copy).
        torch.add(tm[:, 0], tm[:, 1], out=am)
        for j in range(2, k):
            am.add_(tm[:, j])
        om.copy_(am)

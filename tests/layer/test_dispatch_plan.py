"""`comm.plan_dispatch` (with its shorter group-of-one-rank path), `comm.exchange` on one
rank and `comm.Workspace`'s reused views, against expectations built here from their
definitions in plain Python."""

from __future__ import annotations

import pytest
import torch

from moe_ep.backends.portable import comm


def _expected_plan(ids: list[list[int]], e_local: int, world: int, dedup: bool) -> dict:
    """The plan by its definition: pairs in (destination, token, slot) order, padded slots
    (-1) dropped; with dedup one payload row per (destination, token), else one per pair."""
    pairs = [
        (ex // e_local, t, j, ex % e_local)
        for t, row in enumerate(ids)
        for j, ex in enumerate(row)
        if ex >= 0
    ]
    pairs.sort(key=lambda p: (p[0], p[1], p[2]))
    rows: list[tuple[int, int]] = []  # (destination, token) per payload row, in send order
    meta = []
    for dest, t, _, local in pairs:
        if not dedup or not rows or rows[-1] != (dest, t):
            rows.append((dest, t))
        first_of_dest = next(i for i, r in enumerate(rows) if r[0] == dest)
        meta.append([len(rows) - 1 - first_of_dest, local])
    return {
        "pair_token": [p[1] for p in pairs],
        "pair_slot": [p[2] for p in pairs],
        "row_token": [t for _, t in rows],
        "pair_meta": meta,
        "row_counts": [sum(r[0] == d for r in rows) for d in range(world)],
        "pair_counts": [sum(p[0] == d for p in pairs) for d in range(world)],
    }


def _routing(seed: int, n: int, k: int, experts: int, padded: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty((n, k), dtype=torch.int64)
    for t in range(n):
        ids[t] = torch.randperm(experts, generator=g)[:k]
    ids[torch.rand(n, k, generator=g) < padded] = -1
    if n > 2 and padded:
        ids[1] = -1  # a token with no valid slot
    if n and k > 1:
        ids[0, 1] = ids[0, 0]  # an expert chosen twice by one token
    return ids


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize(("n", "padded"), [(0, 0.0), (1, 0.0), (7, 0.0), (37, 0.3), (5, 1.0)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_plan_matches_its_definition(
    world: int, dedup: bool, n: int, padded: float, dtype: torch.dtype
) -> None:
    e_local, k = 4, 3
    ids = _routing(n * 10 + world, n, k, e_local * world, padded).to(dtype)
    plan = comm.plan_dispatch(ids, e_local, world, dedup)
    want = _expected_plan(ids.tolist(), e_local, world, dedup)
    for name in ("pair_token", "pair_slot", "row_token", "pair_meta"):
        got = getattr(plan, name)
        assert got.tolist() == want[name] or (got.numel() == 0 and not want[name]), name
    assert plan.pair_meta.dtype == torch.int32
    assert plan.pair_token.dtype == plan.pair_slot.dtype == plan.row_token.dtype == torch.int64
    assert (plan.row_counts, plan.pair_counts) == (want["row_counts"], want["pair_counts"])


@pytest.mark.parametrize("with_weight", [False, True])
def test_exchange_on_one_rank_hands_the_rows_on(with_weight: bool) -> None:
    ids = _routing(3, 9, 3, 5, 0.3)
    plan = comm.plan_dispatch(ids, 5, 1, True)
    payload = torch.randn(plan.row_counts[0], 6)
    weight = torch.rand(plan.pair_counts[0]) if with_weight else None
    recv = comm.exchange(plan, payload, group=None, rank=0, world_size=1, pair_weight=weight)
    assert recv.rows is payload  # no collective, no copy
    assert recv.pair_row.tolist() == plan.pair_meta[:, 0].tolist()
    assert recv.pair_expert.tolist() == ids[ids >= 0].tolist()  # token-major, the ids
    assert recv.pair_row.dtype == recv.pair_expert.dtype == torch.int64
    assert recv.pair_counts == plan.pair_counts
    if weight is None:
        assert recv.pair_weight is None
    else:
        assert recv.pair_weight is not None and torch.equal(recv.pair_weight, weight)
    # each pair's row is its token's
    assert torch.equal(plan.row_token[recv.pair_row], plan.pair_token)


def test_plan_of_no_slots_sends_nothing() -> None:
    ids = torch.empty((3, 0), dtype=torch.int64)
    for world in (1, 2):
        plan = comm.plan_dispatch(ids, 4, world, True)
        assert plan.row_token.numel() == plan.pair_token.numel() == 0
        assert plan.row_counts == plan.pair_counts == [0] * world


CPU = torch.device("cpu")


def test_workspace_reuses_a_view_only_for_the_same_request() -> None:
    ws = comm.Workspace()
    a = ws.get("x", (4, 8), torch.float32, CPU)
    assert ws.get("x", (4, 8), torch.float32, CPU) is a
    assert ws.get("x", [4, 8], torch.float32, CPU) is a  # type: ignore[arg-type]
    b = ws.get("x", (8, 4), torch.float32, CPU)
    assert tuple(b.shape) == (8, 4) and b.data_ptr() == a.data_ptr()
    c = ws.get("x", (4, 8), torch.bfloat16, CPU)
    assert c.dtype == torch.bfloat16 and tuple(c.shape) == (4, 8)
    d = ws.get("x", (64, 8), torch.float32, CPU)  # grown: a new buffer
    assert tuple(d.shape) == (64, 8) and d.data_ptr() != a.data_ptr()
    again = ws.get("x", (4, 8), torch.float32, CPU)  # the first request: the new buffer
    assert again.data_ptr() == d.data_ptr() and tuple(again.shape) == (4, 8)
    ws.clear()
    e = ws.get("x", (64, 8), torch.float32, CPU)
    assert tuple(e.shape) == (64, 8)


def test_workspace_view_from_inference_mode_is_not_reused_outside_it() -> None:
    ws = comm.Workspace()
    ws.get("x", (64, 8), torch.float32, CPU)  # the buffer, outside inference mode
    with torch.inference_mode():
        ws.get("x", (4, 8), torch.float32, CPU).fill_(1.0)
    ws.get("x", (4, 8), torch.float32, CPU).fill_(2.0)  # an inference tensor would raise

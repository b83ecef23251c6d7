"""The collective sweep: every rank measures every candidate, the slowest rank's time
counts, so every rank sees the same timings and picks the same winner."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moe_ep.tuning.cache import TuningCache, TuningKey

Candidate = Mapping[str, Any]
Measure = Callable[[Candidate], float]
"""One rank's seconds for a candidate (inf: the candidate cannot run here)."""


def candidate_id(candidate: Candidate) -> str:
    """A candidate's stable name, e.g. '{"dedup": false}'."""
    return json.dumps(dict(candidate), sort_keys=True)


def agreed_tokens(runtime: Any, local_tokens: int) -> int:
    """Collective: the largest live-token count of any rank (every rank keys the same
    bucket, as flashinfer 0.7.4's tuner does)."""
    return max(int(t) for t in runtime.gather_json(int(local_tokens), what="tune: live tokens"))


@dataclass(frozen=True)
class Winner:
    knobs: dict[str, Any]
    seconds: float
    timings: dict[str, float]
    resumed: int
    """Candidates whose timing came from an interrupted sweep's record."""


def run_sweep(
    runtime: Any,
    key: TuningKey,
    grid: Sequence[Candidate],
    measure: Measure,
    cache: TuningCache,
    say: Callable[[str], None] = lambda what: None,
) -> Winner:
    """Collective: time each candidate of `grid` (skipping those an interrupted sweep of
    `key` already timed, as rank 0's cache records them), agree on each time as the max
    over ranks, and record the fastest (first in grid order on a tie) in `cache` (rank 0
    writes). Every rank returns the same `Winner`."""
    if not grid:
        raise ValueError("run_sweep needs at least one candidate")
    rank = runtime.rank
    saved = cache.sweep(key) if rank == 0 else {}
    done: dict[str, float] = runtime.gather_json(saved, what="tune: resumed timings")[0]
    resumed = sum(candidate_id(c) in done for c in grid)
    for j, cand in enumerate(grid):
        cid = candidate_id(cand)
        if cid in done:
            say(f"candidate {j + 1}/{len(grid)} {cid}: {done[cid] * 1e3:.2f} ms (resumed)")
            continue
        say(f"candidate {j + 1}/{len(grid)} {cid}")
        local = float(measure(cand))
        # JSON has no inf: a candidate that cannot run on some rank is sent as None
        got = runtime.gather_json(None if local == float("inf") else local, what="tune: timing")
        done[cid] = float("inf") if None in got else max(got)
        if rank == 0 and done[cid] != float("inf"):  # a refused candidate is re-tried
            cache.save_timing(key, cid, done[cid])
    order = {candidate_id(c): j for j, c in enumerate(grid)}
    best = min(order, key=lambda cid: (done[cid], order[cid]))
    if done[best] == float("inf"):
        raise RuntimeError(f"tune {key.ident()}: no candidate could run on every rank")
    timings = {cid: done[cid] for cid in order}
    winner = Winner(dict(grid[order[best]]), done[best], timings, resumed)
    if rank == 0:
        finite = {cid: (None if t == float("inf") else t) for cid, t in timings.items()}
        cache.record(key, winner.knobs, winner.seconds, finite)
    runtime.barrier()
    return winner

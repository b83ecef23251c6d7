"""A bench row merged over ranks, its figures and ratios, and the JSON document."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from moe_ep.bench.harness import RankRow
from moe_ep.bench.limits import useful_flops
from moe_ep.bench.shapes import BenchShape
from moe_ep.bench.targets import AT_LIMIT, DENSE_TOO, Target, row_status, with_bound_note

SCHEMA = "moe-ep-bench/1"
RATIOS = ("vs_dense", "vs_bandwidth", "vs_all_to_all", "naive_over_layer", "peer_over_layer")
"""Ratio names: layer / dense GEMMs, layer / bandwidth limit, layer / bare all_to_all of
the same bytes, naive loop / layer, transformers' fastest / layer."""


@dataclass
class BenchRow:
    """One (shape, world size, routing, kernel): the forward's time of each run (the
    slowest rank's) and the limits (the slowest rank's medians)."""

    shape: BenchShape
    world_size: int
    routing: str
    kernel: str
    runs: list[float]
    limits: dict[str, float]
    notes: dict[str, str]
    skipped: str = ""
    targets: dict[str, Target] = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.runs) if self.runs else None

    def tokens_per_s(self) -> float | None:
        """Tokens of all ranks per second."""
        t = self.median
        return None if not t else self.shape.tokens * self.world_size / t

    def tflops(self) -> float | None:
        """Useful TFLOP/s per rank (the published mega-MoE figures' convention): a rank's
        share of the fleet's pairs (tokens per rank x k), FC1 + FC2, over the forward."""
        t = self.median
        if not t:
            return None
        s = self.shape
        return useful_flops(s.tokens * s.topk, s.hidden, s.inter) / t / 1e12

    def dense(self) -> float | None:
        have = [self.limits[k] for k in ("dense bf16", "dense fp32") if k in self.limits]
        return min(have) if have else None

    def peer(self) -> tuple[str, float] | None:
        """transformers' fastest experts implementation: (name, median s)."""
        peers = {k: v for k, v in self.limits.items() if k.startswith("hf ")}
        if not peers:
            return None
        best = min(peers, key=lambda k: peers[k])
        return best, peers[best]

    def ratios(self) -> dict[str, float | None]:
        t = self.median
        if not t:
            return dict.fromkeys(RATIOS)
        dense, peer = self.dense(), self.peer()
        a2a, naive = self.limits.get("all_to_all"), self.limits.get("naive")
        bw = self.limits.get("bandwidth")
        return {
            "vs_dense": None if dense is None else t / dense,
            "vs_bandwidth": None if not bw else t / bw,
            "vs_all_to_all": None if a2a is None else t / a2a,
            "naive_over_layer": None if naive is None else naive / t,
            "peer_over_layer": None if peer is None else peer[1] / t,
        }

    def status(self) -> str:
        if self.skipped:
            return "skipped"
        r = self.ratios()
        judged = row_status((k, r[k], self.targets.get(k)) for k in RATIOS)
        bw, dense, peer = self.limits.get("bandwidth"), self.dense(), self.peer()
        if not bw or r["vs_bandwidth"] is None:
            return judged
        if dense is not None:
            judged = with_bound_note(
                judged, self.targets.get("vs_bandwidth"), r["vs_bandwidth"], dense / bw, DENSE_TOO
            )
        if peer is not None and r["peer_over_layer"] is not None:
            judged = with_bound_note(
                judged, self.targets.get("peer_over_layer"), r["peer_over_layer"], peer[1] / bw,
                AT_LIMIT,
            )  # fmt: skip
        return judged

    def as_dict(self) -> dict[str, Any]:
        peer = self.peer()
        return {
            "shape": self.shape.as_dict(),
            "world_size": self.world_size,
            "routing": self.routing,
            "kernel": self.kernel,
            "skipped": self.skipped or None,
            "runs_s": self.runs,
            "median_s": self.median,
            "tokens_per_s": self.tokens_per_s(),
            "useful_tflops_per_rank": self.tflops(),
            "limits_s": dict(self.limits),
            "limit_notes": dict(self.notes),
            "peer": None if peer is None else peer[0],
            "ratios": self.ratios(),
            "targets": {k: t.label() for k, t in self.targets.items()},
            "status": self.status(),
        }


def merge(world_size: int, per_rank: list[list[RankRow]]) -> list[BenchRow]:
    """Rows of every rank (the same order on each) -> one row each: run i takes the slowest
    rank's time in run i; each limit the slowest rank's."""
    out = []
    for rows in zip(*per_rank, strict=True):
        first = rows[0]
        skipped = next((r.skipped for r in rows if r.skipped), "")
        runs = [] if skipped else [max(v) for v in zip(*(r.runs for r in rows), strict=True)]
        keys = dict.fromkeys(k for r in rows for k in r.limits)
        limits = {k: max(r.limits[k] for r in rows if k in r.limits) for k in keys}
        out.append(
            BenchRow(
                first.shape,
                world_size,
                first.routing,
                first.kernel,
                runs,
                limits,
                dict(first.limit_notes),
                skipped,
            )
        )
    return out


def document(
    rows: list[BenchRow],
    *,
    machine: dict[str, Any],
    device: str,
    timing: str,
    reps: int,
    warmup: int,
    bandwidth: dict[int, float],
    command: list[str],
) -> dict[str, Any]:
    """The `--json` document."""
    return {
        "schema": SCHEMA,
        "command": command,
        "machine": machine,
        "device": device,
        "timing": timing,
        "reps": reps,
        "warmup": warmup,
        "read_bandwidth_bytes_per_s": {str(k): v for k, v in bandwidth.items()},
        "rows": [r.as_dict() for r in rows],
    }

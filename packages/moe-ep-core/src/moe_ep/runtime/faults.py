"""One verdict per fault, agreed through the store: which EP ranks failed, and why.

Never a collective on the broken group: every rank that fails or sees a failure writes its
entry on the board (`fault/rank/<r>`: "failed" with its reason, or "alive" with what it
saw) and raises the flag `fault/open`. A rank blocked in a moe-ep wait sees the flag at
its next poll and checks in. Once every rank has an entry, or `grace_s` after a rank
started agreeing, that rank proposes the verdict (failed = ranks that said so plus ranks
that did not check in) with an atomic `compare_set` on `fault/verdict`: the first proposal
wins and every survivor raises it, so all raise the same class with the same ranks.

The store's host cannot be outvoted: if the store is lost (its host died or stopped),
every survivor concludes on its own that the host's rank failed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError
from moe_ep.runtime.bounded import BoundedStore, StoreLost, grace_s
from moe_ep.runtime.keys import Keys

__all__ = ["WHAT_TO_DO", "FaultBoard", "Verdict"]

WHAT_TO_DO = (
    "the EP group is unusable now: destroy every MoEEpLayer on this runtime and release "
    "every Runtime handle (a later acquire() bootstraps a new group; with a host's "
    "process_group the host must create a new group), or restart the processes"
)


@dataclass(frozen=True)
class Verdict:
    """Failed EP ranks (sorted), what is known about each, and whether the fault was seen
    only as a timeout (then every survivor raises `MoeEpTimeoutError`, else
    `MoeEpPeerError`)."""

    failed: tuple[int, ...]
    reasons: Mapping[int, str] = field(default_factory=dict)
    timed_out: bool = False

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "failed": list(self.failed),
                "reasons": {str(r): w for r, w in self.reasons.items()},
                "timed_out": self.timed_out,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Verdict | None:
        try:
            raw = json.loads(data)
            return cls(
                tuple(sorted(int(r) for r in raw["failed"])),
                {int(r): str(w) for r, w in raw["reasons"].items()},
                bool(raw["timed_out"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def describe(self) -> str:
        if not self.failed:
            return "the failed rank(s) could not be determined"
        said = "; ".join(f"rank {r}: {self.reasons[r]}" for r in self.failed if r in self.reasons)
        return f"rank(s) {list(self.failed)} failed" + (f" ({said})" if said else "")

    def error(self, what: str, *, rank: int, world_size: int, timeout_s: float) -> MoeEpPeerError:
        """The exception every survivor raises for this verdict."""
        cls = MoeEpTimeoutError if self.timed_out else MoeEpPeerError
        return cls(
            f"{what}: {self.describe()}; world size {world_size}, timeout {timeout_s:g} s, "
            f"seen from rank {rank}; {WHAT_TO_DO}",
            failed_ranks=self.failed,
            reasons=self.reasons,
        )


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class FaultBoard:
    """The fault keys of one runtime lifetime (or of one bootstrap) in `store`."""

    def __init__(
        self, store: BoundedStore, keys: Keys, *, rank: int, world_size: int, timeout_s: float
    ) -> None:
        self.store = store
        self.keys = keys
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.grace = grace_s(timeout_s)
        self._open = keys.key("open")
        self._verdict = keys.key("verdict")
        self._acks = keys.key("acks")
        self._entries = [keys.key(f"rank/{r}") for r in range(world_size)]

    # -- writing ------------------------------------------------------------------------
    def _put(self, key: str, payload: bytes, deadline: float) -> None:
        self.store.set(key, self.keys.pack(key, payload), deadline)

    def _read(self, key: str, deadline: float) -> bytes | None:
        if not self.store.check([key], deadline):
            return None
        return self.keys.unpack(key, self.store.get(key, deadline))

    def report_failed(self, reason: str) -> None:
        """This rank failed outside a collective (e.g. bad input): tell the others at once.
        Best effort: a lost store has nobody to tell."""
        deadline = time.monotonic() + self.grace
        entry = self._entries[self.rank]
        try:
            self._put(entry, json.dumps({"failed": _one_line(reason)}).encode(), deadline)
            self._put(self._open, str(self.rank).encode(), deadline)
        except StoreLost:
            pass

    # -- polling ------------------------------------------------------------------------
    def is_open(self, deadline: float) -> bool:
        return self.store.check([self._open], deadline)

    def open_async(self) -> Any:
        """A pending `check` of the flag (a Future of bool), or None (see BoundedStore)."""
        return self.store.check_async([self._open])

    def lost_verdict(self, lost: StoreLost) -> Verdict:
        """What every survivor concludes on its own when the store is gone: its host's rank
        failed (nothing, when the host is no EP rank)."""
        host = self.store.host_rank
        if host is None:
            return Verdict((), {}, lost.timed_out)
        how = "stopped answering" if lost.timed_out else "went away"
        return Verdict((host,), {host: f"hosts the rendezvous store, which {how}"}, lost.timed_out)

    # -- agreeing -----------------------------------------------------------------------
    def _adopt(self, value: bytes | None, deadline: float) -> Verdict | None:
        verdict = None if value is None else Verdict.from_json(value)
        if verdict is not None:
            self.store.add(self._acks, 1, deadline)
        return verdict

    def decide(self, verdict: Verdict) -> Verdict:
        """Propose `verdict` (a rank that knows the answer, e.g. a barrier's rank 0); returns
        the one that won."""
        start = time.monotonic()
        deadline = start + 2 * self.grace
        try:
            won = self._propose(verdict, deadline)
            if self.store.host_rank == self.rank:
                self.linger(start + self.grace)
            return won
        except StoreLost as lost:
            return self.lost_verdict(lost)

    def _propose(self, verdict: Verdict, deadline: float) -> Verdict:
        packed = self.keys.pack(self._verdict, verdict.to_json())
        held = self.store.compare_set(self._verdict, b"", packed, deadline)
        self._put(self._open, str(self.rank).encode(), deadline)
        won = self._adopt(self.keys.unpack(self._verdict, held), deadline)
        return verdict if won is None else won

    def agree(self, observed: str) -> Verdict:
        """Check in as alive (having `observed` the failure: "timeout", "board" or an error's
        text) and return the verdict, within `2 * grace` of the call."""
        start = time.monotonic()
        until, deadline = start + self.grace, start + 2 * self.grace
        try:
            existing = self._adopt(self._read(self._verdict, deadline), deadline)
            if existing is not None:
                return existing
            mine = json.dumps({"alive": _one_line(observed)}).encode()
            self._put(self._entries[self.rank], mine, deadline)
            self._put(self._open, str(self.rank).encode(), deadline)
            pause = 0.001
            while not self.store.check(self._entries, deadline):
                if self.store.check([self._verdict], deadline):
                    break
                if time.monotonic() >= until:
                    break
                time.sleep(pause)
                pause = min(2 * pause, 0.02)
            existing = self._adopt(self._read(self._verdict, deadline), deadline)
            if existing is not None:
                return existing
            return self._propose(self._proposal(deadline), deadline)
        except StoreLost as lost:
            return self.lost_verdict(lost)

    def _proposal(self, deadline: float) -> Verdict:
        failed: list[int] = []
        reasons: dict[int, str] = {}
        errors_seen = False
        for r, key in enumerate(self._entries):
            raw = self._read(key, deadline)
            entry: Any = None
            if raw is not None:
                try:
                    entry = json.loads(raw)
                except ValueError:
                    entry = None
            if not isinstance(entry, dict) or not ({"alive", "failed"} & set(entry)):
                failed.append(r)
                reasons[r] = f"did not answer within {self.grace:g} s of the failure"
            elif "failed" in entry:
                failed.append(r)
                reasons[r] = str(entry["failed"])
                errors_seen = True
            elif str(entry["alive"]) not in ("timeout", "board"):
                errors_seen = True
        return Verdict(tuple(failed), reasons, timed_out=not errors_seen)

    def await_verdict(self) -> Verdict:
        """A rank that came too late to take part (a closed barrier): the verdict once one
        is there (within `grace`), else agree."""
        start = time.monotonic()
        deadline = start + 2 * self.grace
        try:
            while time.monotonic() < start + self.grace:
                found = self._adopt(self._read(self._verdict, deadline), deadline)
                if found is not None:
                    return found
                time.sleep(0.01)
        except StoreLost as lost:
            return self.lost_verdict(lost)
        return self.agree("timeout")

    def linger(self, until: float) -> None:
        """The store's host, before it goes: wait (until `until`) for every rank to have
        read the verdict (a rank counted as failed may only be late), so nobody loses the
        store mid-agreement. Returns at once when no fault was reported, and does not wait
        for ranks that reported their own failure."""
        try:
            if not self.is_open(until):
                return
            while time.monotonic() < until:
                entries = [self._read(k, until) for k in self._entries]
                failed_itself = sum(e is not None and b'"failed"' in e for e in entries)
                if failed_itself == self.world_size:
                    return  # every rank failed on its own: nobody is agreeing
                raw = self._read(self._verdict, until)
                agreed = raw is not None and Verdict.from_json(raw) is not None
                if (
                    agreed
                    and self.store.add(self._acks, 0, until) >= self.world_size - failed_itself
                ):
                    return
                time.sleep(0.01)
        except StoreLost:
            return

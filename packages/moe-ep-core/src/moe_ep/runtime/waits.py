"""Bounded waits on collectives moe-ep issues (`async_op=True` work), on any group.

The group's own timeout is not relied on: a host's gloo group keeps gloo's default of 30
minutes. The work is waited for in short slices; between slices a pending check of the
fault board's flag is read (never blocking the wait: a store that does not answer is just
not asked again), so a peer that reported its own failure ends the wait within a slice or
two. Past `timeout_s`, or when the collective fails, the ranks agree on a verdict through
the store (`moe_ep.runtime.faults`).

A forward whose collectives complete within the first slice pays one `wait(slice)` per
collective and no store call.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from moe_ep.runtime.faults import FaultBoard, Verdict

__all__ = ["SLICE_S", "wait_work"]

SLICE_S = 0.02
"""Seconds of one slice of a wait (and the poll period of the fault flag)."""

_SLICE = datetime.timedelta(seconds=SLICE_S)
_PENDING = "pending"  # a slice ran out, the work is still running


def _observed(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    lower = text.lower()
    return "timeout" if "timed out" in lower or "timeout" in lower else f"error: {text}"


def _slice_gloo(work: Any) -> BaseException | str | None:
    """Wait one slice: None when the work is done, `_PENDING`, or its failure."""
    try:
        work.wait(_SLICE)
        return None
    except Exception:  # gloo raises "Operation timed out!" when a slice runs out
        if not work.is_completed():
            return _PENDING
    try:  # it may have completed just after the slice ran out: ask once more
        work.wait(_SLICE)
        return None
    except Exception as exc:
        return exc


def _slice_polled(work: Any, pause: float) -> BaseException | str | None:
    """NCCL and other backends: `wait(timeout)` may abort the communicator, so poll
    `is_completed()` for one slice, then `wait()` (which makes the current stream wait).
    Never run on a GPU here."""
    end = time.monotonic() + SLICE_S
    try:
        while not work.is_completed():
            if time.monotonic() >= end:
                return _PENDING
            time.sleep(pause)
            pause = min(2 * pause, 0.001)
        work.wait()
        return None
    except Exception as exc:
        return exc


def wait_work(
    work: Any, *, backend: str, timeout_s: float, board: FaultBoard | None
) -> Verdict | None:
    """Wait for `work` for at most `timeout_s` (plus the agreement, `2 * grace_s`).

    Returns None when it completed, else the verdict the ranks agreed on (a collective
    failed or timed out, or a peer reported a failure on `board`). Without a board (no
    store reachable) the verdict names nobody.
    """
    deadline = time.monotonic() + timeout_s
    gloo = backend == "gloo"
    poll: Any = None
    polled_at = 0.0
    while True:
        failure = _slice_gloo(work) if gloo else _slice_polled(work, 0.00005)
        if failure is None:
            return None
        if isinstance(failure, BaseException):
            observed = _observed(failure)
            return board.agree(observed) if board else Verdict((), {}, observed == "timeout")
        if board is not None:
            if poll is None:
                poll, polled_at = board.open_async(), time.monotonic()
            elif poll.done():
                # a flag that is up, or a store that broke (agree then names its host)
                opened = poll.exception() is not None or bool(poll.result())
                poll = None
                if opened:
                    return board.agree("board")
        now = time.monotonic()
        if now >= deadline:
            if board is None:
                return Verdict((), {}, True)
            if poll is not None and not poll.done() and now - polled_at > board.grace:
                # the store has not answered a check for longer than agreeing may take
                return board.lost_verdict(board.store.declare_lost(now - polled_at))
            return board.agree("timeout")

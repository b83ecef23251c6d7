"""`moe-ep`'s exit codes, and the one `moe-ep: error:` line each failure prints.

| code | meaning |
|---|---|
| 0 | success |
| 1 | a check failed (`--check`, `demo`) |
| 2 | usage error: a bad argument, environment variable or shape, found here or on a rank |
| 3 | unavailable on this machine (no GPU, no C compiler with MOE_EP_CPU_FUSED=1, ...) |
| 4 | a rank failed: killed by a signal, died, raised, or a peer / timeout error |
| 5 | internal error: an unexpected exception in this process (a bug) |
| 128+N | stopped by signal N: 130 SIGINT (Ctrl-C), 143 SIGTERM; the ranks are stopped too |
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from moe_ep.errors import MoeEpError, MoeEpPeerError, MoeEpUnavailableError, MoeEpUsageError
from moe_ep.spawn import LocalRun, RankFailure

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_PEER",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "Terminated",
    "classify",
    "raise_on_terminate",
    "rank_failure_error",
]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE, EXIT_PEER, EXIT_INTERNAL = range(6)

_DEBUG_HINT = "rerun with --debug (or MOE_EP_DEBUG=1) for the tracebacks"


class Terminated(BaseException):
    """SIGTERM arrived (raised in the main thread while `raise_on_terminate` is active).

    A BaseException, so no `except Exception` on the way up swallows it; the `finally`
    blocks on the way (spawn_local's among them) still stop the ranks.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def raise_on_terminate() -> Iterator[None]:
    """While inside, the first SIGTERM raises `Terminated`; later ones are ignored so that
    the clean-up it triggers is not cut short. A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise Terminated(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def classify(exc: BaseException, *, debug: bool = False) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that reached `main`."""
    if isinstance(exc, MoeEpUsageError):
        return EXIT_USAGE, _one_line(str(exc))
    if isinstance(exc, MoeEpUnavailableError):
        return EXIT_UNAVAILABLE, _one_line(str(exc))
    if isinstance(exc, Terminated):
        return 128 + exc.signum, f"terminated by {signal.Signals(exc.signum).name}"
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT, "interrupted (SIGINT)"
    hint = "" if debug else f" ({_DEBUG_HINT})"
    if isinstance(exc, MoeEpPeerError):
        return EXIT_PEER, _one_line(str(exc)) + hint
    what = _one_line(f"{type(exc).__name__}: {exc}")
    return EXIT_INTERNAL, f"internal error: {what} (a bug: please report it{hint})"


def _grouped(failures: list[RankFailure]) -> str:
    """`rank 1: msg` / `ranks [0, 1]: msg` for each distinct message, in rank order."""
    by_message: dict[str, list[int]] = {}
    for f in failures:
        by_message.setdefault(_one_line(f.message), []).append(f.rank)
    return "; ".join(
        f"rank {ranks[0]}: {msg}" if len(ranks) == 1 else f"ranks {ranks}: {msg}"
        for msg, ranks in by_message.items()
    )


def rank_failure_error(run: LocalRun) -> MoeEpError:
    """The one-line error of a `LocalRun` that did not succeed, of its root cause's kind.

    A usage (or unavailable) error on any rank wins: it is the cause, and the peer errors
    of the other ranks follow from it. Otherwise the ranks that were killed, died or raised
    something other than a peer error are named first, the ranks that then failed waiting
    for them after, with what to do.
    """
    for family in (MoeEpUsageError, MoeEpUnavailableError):
        hits = [f for f in run.failures if f.family == family.__name__]
        if hits:
            return family(_grouped(hits))
    waiting = ("MoeEpPeerError", "MoeEpTimeoutError")
    causes = [f for f in run.failures if f.family not in waiting] or [
        f for f in run.failures if f.rank == run.first_failure
    ]
    parts = [f.describe() for f in causes]
    followers = [f.rank for f in run.failures if f not in causes]
    if followers:
        parts.append(f"then rank(s) {followers} failed waiting for their peers")
    stopped = list(run.stopped)
    if stopped and run.failures:
        parts.append(f"rank(s) {stopped} were stopped {run.failure_grace_s:g} s later")
    elif stopped:
        parts.append(
            f"rank(s) {stopped} of {run.world_size} had not finished after "
            f"{run.timeout_s:g} s and were stopped"
        )
    if any(f.signal_name == "SIGKILL" for f in causes):
        parts.append(
            "use fewer ranks (--world-size) or a smaller shape, or free memory "
            "(`dmesg` names the killer)"
        )
    return MoeEpPeerError(
        "; ".join(parts),
        rank_errors={f.rank: f.error_type for f in run.failures if f.error_type},
    )

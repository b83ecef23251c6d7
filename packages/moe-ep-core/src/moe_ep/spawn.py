"""`spawn_local` / `launch_local`: run a function on N local ranks in fresh processes (tests,
demo, `run`).

Ranks never outlive the process that launched them: each holds the read end of a watchdog
pipe whose only write end the launcher holds, and exits when that end closes (the launcher
finished, exited or was killed, SIGKILL included). A parent-death signal (PR_SET_PDEATHSIG)
would not do: a rank's parent is the forkserver, which its ranks keep alive (they hold its
"alive" pipe), not the launcher. Stopping ranks (timeout, after a failure's grace period, or
an exception in the launcher such as the CLI's SIGTERM) sends SIGTERM, then SIGKILL to any
still alive `STOP_GRACE_S` later.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from moe_ep.errors import (
    MoeEpPeerError,
    MoeEpTimeoutError,
    MoeEpUnavailableError,
    MoeEpUsageError,
)

__all__ = ["STOP_GRACE_S", "LocalRun", "RankFailure", "free_port", "launch_local", "spawn_local"]

STOP_GRACE_S = 2.0
"""Seconds between the SIGTERM and the SIGKILL that stop a rank."""

_FAMILIES = (MoeEpUsageError, MoeEpUnavailableError, MoeEpTimeoutError, MoeEpPeerError)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _context() -> Any:
    # forkserver: every child is a fresh interpreter state (no inherited CUDA context or
    # process group), forked from a server that imported torch once, so a rank starts in
    # well under a second instead of re-importing torch. spawn where forkserver is missing.
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        return ctx
    return mp.get_context("spawn")


def _exit_when_closed(watchdog: Any) -> None:
    with contextlib.suppress(EOFError, OSError):
        watchdog.recv_bytes()  # the launcher never writes: this returns only at EOF
    os._exit(1)  # the launcher is gone: so is this rank


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    environ: dict[str, str],
    conn: Any,
    watchdog: Any,
) -> None:
    threading.Thread(target=_exit_when_closed, args=(watchdog,), daemon=True).start()
    # The forkserver was started with an older environment: reproduce the parent's now.
    os.environ.clear()
    os.environ.update(environ)
    try:
        result = fn(rank, world_size, *args)
    except BaseException as exc:
        family = next((c.__name__ for c in _FAMILIES if isinstance(exc, c)), "")
        conn.send(("err", type(exc).__name__, family, str(exc), traceback.format_exc()))
        conn.close()
        os._exit(1)
    try:
        conn.send(("ok", result))
    except Exception as exc:  # unpicklable result
        why = f"its result could not be sent: {exc!r}"
        conn.send(("err", type(exc).__name__, "", why, ""))
    conn.close()


@dataclass(frozen=True)
class RankFailure:
    """A rank that raised, or died without a result.

    `error_type` is the class name of what it raised (None: it died); `family` the moe-ep
    error family that exception belongs to (`MoeEpUsageError`, `MoeEpUnavailableError`,
    `MoeEpTimeoutError`, `MoeEpPeerError`), "" for any other exception or a death;
    `exitcode` the process's (negative: killed by that signal).
    """

    rank: int
    error_type: str | None
    family: str
    message: str
    traceback: str
    exitcode: int | None

    @property
    def signal_name(self) -> str | None:
        """The signal that killed the rank (e.g. "SIGKILL"), None if none did."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def describe(self) -> str:
        """One line: what happened to this rank."""
        if self.error_type is not None:
            return f"rank {self.rank} raised {self.error_type}: {' '.join(self.message.split())}"
        sig = self.signal_name
        if sig is None:
            return f"rank {self.rank} died (exit code {self.exitcode}) without a result"
        cause = ", usually the out-of-memory killer" if sig == "SIGKILL" else ""
        return f"rank {self.rank} was killed by {sig} (exit code {self.exitcode}){cause}"


@dataclass(frozen=True)
class LocalRun:
    """What `launch_local` saw: results, failures and the ranks it had to stop.

    `failures` are in rank order; `first_failure` is the rank whose failure was seen first;
    `stopped` the ranks still running when the launcher stopped them (after `timeout_s`, or
    `failure_grace_s` after the first failure).
    """

    world_size: int
    results: dict[int, Any]
    failures: tuple[RankFailure, ...]
    first_failure: int | None
    stopped: tuple[int, ...]
    timeout_s: float
    failure_grace_s: float

    @property
    def ok(self) -> bool:
        return not self.failures and not self.stopped

    def error(self) -> MoeEpPeerError | None:
        """The error `spawn_local` raises for this run (every rank's traceback), None if ok."""
        details = []
        for f in self.failures:
            if f.error_type is not None:
                details.append(f"rank {f.rank} raised {f.error_type}: {f.message}\n{f.traceback}")
            else:
                details.append(f.describe())
        stopped = list(self.stopped)
        if stopped and self.first_failure is None:
            msg = (
                f"spawn_local timed out after {self.timeout_s:g} s: rank(s) {stopped} of world "
                f"size {self.world_size} had not finished and were stopped"
            )
            return MoeEpTimeoutError("\n".join([msg, *details]))
        if stopped:
            details.append(
                f"rank(s) {stopped} were still running {self.failure_grace_s:g} s after rank "
                f"{self.first_failure} failed and were stopped"
            )
        if not details:
            return None
        ranks = [f.rank for f in self.failures]
        return MoeEpPeerError(
            f"spawn_local: rank(s) {ranks} of world size {self.world_size} failed:\n"
            + "\n".join(details),
            rank_errors={f.rank: f.error_type for f in self.failures if f.error_type},
        )

    def values(self) -> list[Any]:
        """The results in rank order; raises `error()` unless every rank returned."""
        error = self.error()
        if error is not None:
            raise error
        return [self.results[r] for r in range(self.world_size)]


def _stop(procs: list[Any]) -> None:
    """SIGTERM every live process, SIGKILL those still alive `STOP_GRACE_S` later."""
    alive = [p for p in procs if p.is_alive()]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in alive:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in alive:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join()


def launch_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    failure_grace_s: float = 10.0,
) -> LocalRun:
    """`spawn_local`, but returns what happened (`LocalRun`) instead of raising for it.

    Raises:
        MoeEpUsageError: a bad argument (before any process starts).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise MoeEpUsageError(f"world_size must be an int >= 1, got {world_size!r}")
    if not (isinstance(timeout_s, int | float) and timeout_s > 0):
        raise MoeEpUsageError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    if not (isinstance(failure_grace_s, int | float) and failure_grace_s >= 0):
        raise MoeEpUsageError(f"failure_grace_s must be a number >= 0, got {failure_grace_s!r}")
    ctx = _context()
    port = free_port()
    procs: list[Any] = []
    readers: dict[Any, int] = {}  # pipe reader -> rank
    outcome: dict[int, tuple[Any, ...]] = {}
    deadline = math.inf
    first_failure: int | None = None
    watchdog_r, watchdog_w = ctx.Pipe(duplex=False)
    try:
        for rank in range(world_size):
            environ = dict(os.environ)
            environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
            )
            environ.update(env or {})
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child,
                args=(fn, rank, world_size, args, environ, writer, watchdog_r),
                name=f"moe-ep-rank{rank}",
                # not daemonic: a rank may need its own child processes (compile workers);
                # the `finally` below stops every rank whatever happens
                daemon=False,
            )
            proc.start()
            writer.close()
            procs.append(proc)
            readers[reader] = rank
        watchdog_r.close()  # every rank has its copy; only they may hold the read end
        # counted from here: the first call also starts the forkserver (imports torch)
        deadline = time.monotonic() + timeout_s
        pending = dict(readers)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in mpc.wait(list(pending), timeout=remaining):
                rank = pending.pop(conn)
                got: Any = conn
                try:
                    outcome[rank] = got.recv()
                except EOFError:
                    outcome[rank] = ("dead",)
                got.close()
                if outcome[rank][0] != "ok" and first_failure is None:
                    first_failure = rank
                    deadline = min(deadline, time.monotonic() + failure_grace_s)
        for proc in procs:
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        _stop(procs)
        watchdog_w.close()  # any rank not stopped above (a start cut short) exits now
        watchdog_r.close()
        for conn in readers:
            conn.close()
    failures = []
    for rank in sorted(outcome):
        out = outcome[rank]
        if out[0] == "err":
            _, error_type, family, message, tb = out
            failures.append(
                RankFailure(rank, error_type, family, message, tb, procs[rank].exitcode)
            )
        elif out[0] == "dead":
            failures.append(RankFailure(rank, None, "", "", "", procs[rank].exitcode))
    return LocalRun(
        world_size=world_size,
        results={r: out[1] for r, out in outcome.items() if out[0] == "ok"},
        failures=tuple(failures),
        first_failure=first_failure,
        stopped=tuple(r for r in range(world_size) if r not in outcome),
        timeout_s=float(timeout_s),
        failure_grace_s=float(failure_grace_s),
    )


def spawn_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    failure_grace_s: float = 10.0,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh local processes.

    Each process gets MASTER_ADDR=127.0.0.1, MASTER_PORT=<a free port>, RANK, WORLD_SIZE and
    LOCAL_RANK (then `env` on top). `fn` must be a picklable top-level function and its
    return value picklable.

    `timeout_s` counts from the moment every process has started. Once a rank has failed,
    the others get `failure_grace_s` more seconds (their own bounded waits usually end with
    an error worth reporting), then are stopped (SIGTERM, then SIGKILL). Ranks exit when
    this process does, however it ends (module docstring).

    Returns:
        The return values in rank order.

    Raises:
        MoeEpPeerError: one or more ranks raised or died; names each rank with its
            traceback (or the signal that killed it), and the ranks stopped after the
            grace period.
        MoeEpTimeoutError: `timeout_s` passed; all children are stopped and the message
            names the ranks that had not finished.
    """
    run = launch_local(
        fn, world_size, *args, timeout_s=timeout_s, env=env, failure_grace_s=failure_grace_s
    )
    return run.values()

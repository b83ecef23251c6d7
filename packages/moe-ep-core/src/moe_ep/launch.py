"""`spawn_local`: run a function on N local ranks in fresh processes (tests, demo, `run`)."""

from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError, MoeEpUsageError

__all__ = ["free_port", "spawn_local"]


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


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    environ: dict[str, str],
    conn: Any,
) -> None:
    # The forkserver was started with an older environment: reproduce the parent's now.
    os.environ.clear()
    os.environ.update(environ)
    try:
        result = fn(rank, world_size, *args)
    except BaseException as exc:
        name = type(exc).__name__
        conn.send(("err", f"{name}: {exc}", traceback.format_exc(), name))
        conn.close()
        os._exit(1)
    try:
        conn.send(("ok", result))
    except Exception as exc:  # unpicklable result
        conn.send(("err", f"result of rank {rank} could not be sent: {exc!r}", "", ""))
    conn.close()


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
    an error worth reporting), then are killed.

    Returns:
        The return values in rank order.

    Raises:
        MoeEpPeerError: one or more ranks raised or died; names each rank with its
            traceback, and the ranks killed after the grace period.
        MoeEpTimeoutError: `timeout_s` passed; all children are killed and the message
            names the ranks that had not finished.
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
                args=(fn, rank, world_size, args, environ, writer),
                name=f"moe-ep-rank{rank}",
                # not daemonic: a rank may need its own child processes (compile workers);
                # the `finally` below kills every rank whatever happens
                daemon=False,
            )
            proc.start()
            writer.close()
            procs.append(proc)
            readers[reader] = rank
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
        unfinished = [r for r in range(world_size) if r not in outcome]
        for proc in procs:
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join()
        for conn in readers:
            conn.close()
    failures = []
    for rank in sorted(outcome):
        out = outcome[rank]
        if out[0] == "err":
            failures.append(f"rank {rank} raised {out[1]}\n{out[2]}")
        elif out[0] == "dead":
            failures.append(f"rank {rank} died (exit code {procs[rank].exitcode}) without a result")
    if unfinished and first_failure is not None:
        failures.append(
            f"rank(s) {unfinished} were still running {failure_grace_s:g} s after rank "
            f"{first_failure} failed and were killed"
        )
    elif unfinished:
        msg = (
            f"spawn_local timed out after {timeout_s:g} s: rank(s) {unfinished} of world size "
            f"{world_size} had not finished and were killed"
        )
        if failures:
            msg += "\n" + "\n".join(failures)
        raise MoeEpTimeoutError(msg)
    if failures:
        ranks = [r for r in sorted(outcome) if outcome[r][0] != "ok"]
        raise MoeEpPeerError(
            f"spawn_local: rank(s) {ranks} of world size {world_size} failed:\n"
            + "\n".join(failures),
            rank_errors={r: outcome[r][3] for r in ranks if outcome[r][0] == "err"},
        )
    return [outcome[r][1] for r in range(world_size)]

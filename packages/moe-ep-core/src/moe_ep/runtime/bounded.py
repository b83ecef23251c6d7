"""Store calls and blocking setup calls, each with a deadline.

torch's TCPStore client does not bound its calls: with the store's host stopped (SIGSTOP),
`check`, `get`, `add`, `compare_set`, `wait` and a new client's connect block for ever,
whatever the store's own timeout (measured on torch 2.15; only `set` returns, buffered).
So every store call runs on one worker thread per store and is waited for with a deadline.
A call that misses its deadline is abandoned (its thread stays blocked until the host
answers or goes away) and the store counts as lost: every later call raises at once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

__all__ = ["BoundedStore", "StoreLost", "call_with_deadline", "grace_s"]

T = TypeVar("T")

MIN_CALL_S = 0.05
"""A call whose deadline has passed still gets this long (a last read after a timeout)."""


def grace_s(timeout_s: float) -> float:
    """The short wait a timed-out party gets to decide or report (at most 1 s); moe-ep's
    waits end within `timeout_s + 2 * grace_s(timeout_s)` (docs/runtime.md)."""
    return min(1.0, 0.25 * timeout_s + 0.25)


def _remaining(deadline: float) -> float:
    return max(MIN_CALL_S, deadline - time.monotonic())


def call_with_deadline(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """`fn()` on a fresh daemon thread; its result, or `TimeoutError` after `timeout_s`.

    For one-off calls torch does not bound (a store client's connect, the group's
    rendezvous, name resolution). A call that runs late is abandoned, not stopped.
    """
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:
            done.set_exception(exc)

    threading.Thread(target=run, name=f"moe-ep {what}", daemon=True).start()
    try:
        return done.result(timeout=max(0.0, timeout_s))
    except FutureTimeout:
        raise TimeoutError(f"{what} did not return within {timeout_s:g} s") from None


_STOP: Future[Any] = Future()  # tells a worker to exit


def _noop(store: Any) -> None:
    return None


class StoreLost(Exception):
    """The store did not answer in time (`timed_out`) or its connection broke."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class BoundedStore:
    """A `torch.distributed.Store` whose every call takes a deadline (`time.monotonic()`).

    `host_desc` says who serves the store (for messages); `host_rank` is that server's EP
    rank, None when it is not an EP rank (torchelastic's agent, a host's non-EP process).
    A call that raises or misses its deadline raises `StoreLost` and marks the store lost.
    """

    def __init__(self, store: Any, *, host_desc: str, host_rank: int | None) -> None:
        self.raw = store
        self.host_desc = host_desc
        self.host_rank = host_rank
        self.lost: StoreLost | None = None
        self._jobs: queue.SimpleQueue[tuple[Callable[[Any], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._pending = 0
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None

    # -- the worker ---------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if fut is _STOP:
                return
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self.raw))
                    except BaseException as exc:
                        fut.set_exception(exc)
            finally:
                with self._lock:
                    self._pending -= 1

    def _submit(self, fn: Callable[[Any], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._serve, name="moe-ep store calls", daemon=True
                )
                self._worker.start()
            self._pending += 1
        self._jobs.put((fn, fut))
        return fut

    def _call(self, op: str, fn: Callable[[Any], T], deadline: float) -> T:
        if self.lost is not None:
            raise self.lost
        fut = self._submit(fn)
        wait = _remaining(deadline)
        try:
            return fut.result(timeout=wait)
        except FutureTimeout:
            self.lost = StoreLost(
                f"the store hosted by {self.host_desc} did not answer a {op} within {wait:.2g} s",
                timed_out=True,
            )
        except Exception as exc:
            self.lost = StoreLost(
                f"the store hosted by {self.host_desc} failed a {op} ({type(exc).__name__}: {exc})",
                timed_out=False,
            )
            raise self.lost from exc
        raise self.lost

    def declare_lost(self, waited_s: float) -> StoreLost:
        """A call started elsewhere (`check_async`) has not returned for `waited_s`: the
        store counts as lost (timed out); returns why."""
        if self.lost is None:
            self.lost = StoreLost(
                f"the store hosted by {self.host_desc} did not answer a check within "
                f"{waited_s:.2g} s",
                timed_out=True,
            )
        return self.lost

    def close(self) -> None:
        """Stop the worker (after any call still queued) and drop the store, so a store
        this process serves shuts down; later calls raise `StoreLost`."""
        if self.lost is None:
            closed = f"the store hosted by {self.host_desc} was closed"
            self.lost = StoreLost(closed, timed_out=False)
        with self._lock:
            worker, self._worker = self._worker, None
        if worker is not None:
            self._jobs.put((_noop, _STOP))
        self.raw = None

    # -- calls --------------------------------------------------------------------------
    def add(self, key: str, amount: int, deadline: float) -> int:
        return int(self._call("add", lambda s: s.add(key, amount), deadline))

    def set(self, key: str, value: bytes, deadline: float) -> None:
        self._call("set", lambda s: s.set(key, value), deadline)

    def get(self, key: str, deadline: float) -> bytes:
        """The value of `key`, which must exist (a missing key blocks in torch)."""
        return bytes(self._call("get", lambda s: s.get(key), deadline))

    def check(self, keys: Sequence[str], deadline: float) -> bool:
        """Whether every one of `keys` exists."""
        names = list(keys)
        return bool(self._call("check", lambda s: s.check(names), deadline))

    def compare_set(self, key: str, expected: bytes, desired: bytes, deadline: float) -> bytes:
        """Set `key` to `desired` if it holds `expected` (b"": is missing); returns the value
        it holds afterwards (atomic in the store)."""
        swap = lambda s: s.compare_set(key, expected, desired)  # noqa: E731
        return bytes(self._call("compare_set", swap, deadline))

    def check_async(self, keys: Sequence[str]) -> Future[bool] | None:
        """Start a `check` without waiting; None while an earlier call is still running (a
        blocked store is then not asked again) or once the store is lost."""
        if self.lost is not None:
            return None
        with self._lock:
            if self._pending:
                return None
        names = list(keys)
        return self._submit(lambda s: bool(s.check(names)))

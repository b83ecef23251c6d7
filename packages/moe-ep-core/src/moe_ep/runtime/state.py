"""The process-wide runtime state under every `Runtime` handle, and the group-level helpers
that find it (`bounded_wait`, `report_local_failure`).

A process holds at most one `RuntimeState` (`PROCESS.state`), ref-counted by its handles.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError
from moe_ep.runtime.bounded import BoundedStore
from moe_ep.runtime.faults import WHAT_TO_DO, FaultBoard
from moe_ep.runtime.keys import Keys
from moe_ep.runtime.store import store_barrier
from moe_ep.runtime.waits import wait_work

__all__ = [
    "PROCESS",
    "RuntimeState",
    "active_refcount",
    "bounded_wait",
    "report_local_failure",
    "state_of",
]


@dataclass
class RuntimeState:
    """The process-wide runtime under every `Runtime` handle (one per process)."""

    rank: int
    world_size: int
    group: Any
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    created_group: bool
    store: BoundedStore | None  # ours when created_group (HashStore at world size 1), else host's
    keys: Keys  # sealed with the run token once the group exists
    board: FaultBoard | None
    refs: int = 0
    nvshmem: bool = False
    created_nvshmem: bool = False
    host_group: Any = None
    barrier_gen: int = 0
    broken: MoeEpPeerError | None = None  # the failure that made the group unusable
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def timeout_s(self) -> float:
        return self.timeout.total_seconds()

    def check_usable(self, what: str) -> None:
        """Raise at once (no store call, no collective) if the group is gone."""
        cause = self.broken
        if cause is None:
            return
        first = str(cause).split("; " + WHAT_TO_DO)[0]
        raise MoeEpPeerError(
            f"{what}: this moe-ep runtime (rank {self.rank}, world size {self.world_size}) is "
            f"broken since an earlier failure ({first}); {WHAT_TO_DO}",
            failed_ranks=cause.failed_ranks,
            reasons=cause.reasons,
        ) from cause

    def mark_broken(self, cause: MoeEpPeerError) -> None:
        if self.broken is None:
            self.broken = cause

    def wait(self, work: Any, what: str) -> None:
        """Bounded wait of a collective posted on `group` (`moe_ep.runtime.waits`); on a
        failure the runtime is broken and every survivor raises the agreed verdict."""
        verdict = wait_work(work, backend=self.backend, timeout_s=self.timeout_s, board=self.board)
        if verdict is None:
            return
        error = verdict.error(
            what, rank=self.rank, world_size=self.world_size, timeout_s=self.timeout_s
        )
        self.mark_broken(error)
        raise error

    def fail_locally(self, exc: BaseException, what: str) -> None:
        """This rank raised `exc` outside a collective its peers may be waiting in: tell
        them (they fail at once naming this rank) and mark the runtime broken."""
        if self.world_size == 1 or self.broken is not None:
            return
        reason = f"raised {type(exc).__name__} in {what}: {' '.join(str(exc).split())}"
        if self.board is not None:
            self.board.report_failed(reason)
        self.mark_broken(
            MoeEpPeerError(
                f"{what}: rank {self.rank} {reason}; its peers were told",
                failed_ranks=(self.rank,),
                reasons={self.rank: reason},
            )
        )

    def store_barrier(self, name: str, what: str, **kwargs: Any) -> None:
        """A store barrier of this lifetime's sealed keys (`moe_ep.runtime.store`); a
        failure breaks the runtime."""
        assert self.store is not None and self.board is not None
        try:
            store_barrier(
                self.store,
                name,
                keys=self.keys,
                board=self.board,
                rank=self.rank,
                world_size=self.world_size,
                timeout_s=self.timeout_s,
                what=what,
                **kwargs,
            )
        except MoeEpPeerError as exc:
            self.mark_broken(exc)
            raise

    def barrier(self, what: str) -> None:
        """Every rank meets here, over the store, else (a host group whose store torch hides)
        over the group itself; bounded by the timeout."""
        if self.store is not None:
            with self.lock:
                self.barrier_gen += 1
                gen = self.barrier_gen
            self.store_barrier(f"barrier/{gen}", what)
            return
        # No store reachable (a host group torch hides it for): use the group itself.
        try:
            if self.backend == "gloo":
                dist.monitored_barrier(self.group, timeout=self.timeout, wait_all_ranks=True)
                return
            work = dist.barrier(group=self.group, async_op=True)
        except Exception as exc:
            error = MoeEpTimeoutError(
                f"{what}: not every rank arrived within {self.timeout_s:g} s (world size "
                f"{self.world_size}, seen from rank {self.rank}): {exc}; {WHAT_TO_DO}"
            )
            self.mark_broken(error)
            raise error from exc
        self.wait(work, what)


@dataclass
class ProcessRuntime:
    """What this process knows across runtime lifetimes (guarded by `lock`)."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    state: RuntimeState | None = None
    lifetimes: int = 0
    """torch.distributed bootstraps moe-ep has done in this process."""
    abandoned: str | None = None
    """Why an earlier bootstrap left torch.distributed unusable."""


PROCESS = ProcessRuntime()


def active_refcount() -> int:
    """How many unreleased `Runtime` handles this process holds (0 = no runtime state)."""
    with PROCESS.lock:
        return 0 if PROCESS.state is None else PROCESS.state.refs


def state_of(group: Any) -> RuntimeState | None:
    """The active runtime's state when `group` is its group, else None."""
    state = PROCESS.state
    return state if state is not None and state.group is group else None


def bounded_wait(group: Any, work: Any, *, what: str) -> None:
    """Wait for `work` (posted `async_op=True` on `group`) within the active runtime's
    timeout; a failure raises the verdict every survivor raises (`MoeEpPeerError` /
    `MoeEpTimeoutError` with `failed_ranks`) and breaks the runtime. A group moe-ep does
    not manage is waited for plainly."""
    state = state_of(group)
    if state is None:
        work.wait()
        return
    state.wait(work, what)


def post_and_wait(group: Any, post: Callable[[], Any], *, what: str, rank: int) -> None:
    """Post one collective (`post()` returns its `async_op=True` work) and wait for it
    within the runtime's timeout. A failure while posting is this rank's own: re-raised as
    it is, after telling the peers through the fault board; a failure of the collective, or
    a peer's report, raises the verdict every survivor raises (`bounded_wait`)."""
    try:
        work = post()
    except Exception as exc:
        report_local_failure(group, exc, what=f"{what} on rank {rank}")
        raise
    bounded_wait(group, work, what=what)


def report_local_failure(group: Any, exc: BaseException, *, what: str) -> None:
    """This rank raised `exc` where its peers on `group` wait in (or will reach) a
    collective: write it on the fault board so they fail at once naming this rank and
    its reason; the runtime is broken from now on. No-op at world size 1."""
    state = state_of(group)
    if state is not None:
        state.fail_locally(exc, what)

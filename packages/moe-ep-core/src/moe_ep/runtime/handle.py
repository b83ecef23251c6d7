"""`Runtime`: a handle on the process-wide runtime (`moe_ep.runtime.state`)."""

from __future__ import annotations

import datetime
import json
from types import TracebackType
from typing import Any

import torch

from moe_ep.errors import MoeEpPeerError, MoeEpUsageError
from moe_ep.runtime.state import PROCESS, RuntimeState
from moe_ep.runtime.teardown import teardown

__all__ = ["Runtime"]


class Runtime:
    """A handle on the process-wide runtime; `release()` it (or use `with`).

    Attributes (valid until released): `rank`, `world_size`, `group` (the EP
    `torch.distributed.ProcessGroup`), `device` (`cuda:N` or `cpu`), `backend` ("gloo" or
    "nccl"), `timeout` (bound on every wait), `nvshmem` (NVSHMEM initialised), `failure`
    (None, or the error that broke the group).

    `__del__` is deliberately not used for release: teardown is collective, and a garbage
    collector running at different times on different ranks would hang or kill peers.
    """

    def __init__(self, state: RuntimeState) -> None:
        self._state: RuntimeState | None = state

    def _live(self) -> RuntimeState:
        if self._state is None:
            raise MoeEpUsageError("this moe-ep Runtime handle was released; acquire() a new one")
        return self._state

    @property
    def rank(self) -> int:
        return self._live().rank

    @property
    def world_size(self) -> int:
        return self._live().world_size

    @property
    def group(self) -> Any:
        return self._live().group

    @property
    def device(self) -> torch.device:
        return self._live().device

    @property
    def backend(self) -> str:
        return self._live().backend

    @property
    def timeout(self) -> datetime.timedelta:
        return self._live().timeout

    @property
    def nvshmem(self) -> bool:
        return self._live().nvshmem

    @property
    def released(self) -> bool:
        return self._state is None

    @property
    def failure(self) -> MoeEpPeerError | None:
        """The failure that broke the EP group (a peer failed, a wait ran out, or this rank
        raised where its peers waited), None while it is usable. Once broken, every
        collective call raises at once and the last release tears down locally."""
        return self._live().broken

    def check_usable(self, what: str) -> None:
        """Raise `MoeEpPeerError` at once (naming the failed ranks and what to do) if the
        group is broken; no store call, no collective."""
        self._live().check_usable(what)

    def barrier(self) -> None:
        """Collective: every EP rank meets here, bounded by `timeout`.

        Raises:
            MoeEpTimeoutError: names the ranks that did not arrive, the world size and the
                timeout (the runtime is broken from then on).
            MoeEpPeerError: a peer reported a failure, or the group is broken already.
        """
        state = self._live()
        state.check_usable("moe-ep barrier")
        state.barrier("moe-ep barrier")

    def wait(self, work: Any, *, what: str) -> None:
        """Wait for `work` (a collective posted `async_op=True` on `group`) within
        `timeout`, however long the group's own timeout is.

        Raises:
            MoeEpTimeoutError / MoeEpPeerError: the verdict the ranks agreed on through the
                store (`failed_ranks`); the runtime is broken from then on.
        """
        self._live().wait(work, what)

    def report_failure(self, exc: BaseException, *, what: str) -> None:
        """This rank raised `exc` outside a collective (e.g. on bad input) while its peers
        may wait in one: they fail at once naming this rank and `exc`; the runtime is
        broken from then on. No-op at world size 1 or when already broken."""
        self._live().fail_locally(exc, what)

    def gather_json(self, payload: Any, *, what: str) -> list[Any]:
        """Collective: every rank's JSON-able `payload` in rank order, bounded by `timeout`
        (`moe_ep.runtime.gather.gather_json`; world size 1 skips the collective).

        Raises:
            MoeEpTimeoutError / MoeEpPeerError: a rank did not arrive in time or failed
                (names `what` and the failed ranks).
        """
        state = self._live()
        state.check_usable(what)
        if state.world_size == 1:
            return [json.loads(json.dumps(payload, sort_keys=True))]  # same form as gathered
        from moe_ep.runtime.gather import gather_json

        return gather_json(
            state.group, payload, device=state.device, wait=lambda w: state.wait(w, what)
        )

    def release(self) -> None:
        """Drop this handle; idempotent. The last release tears down what moe-ep created
        (collective then: barrier -> destroy -> barrier, each bounded by `timeout`; local
        and immediate on a broken runtime)."""
        with PROCESS.lock:
            state, self._state = self._state, None
            if state is None:
                return
            state.refs -= 1
            if state.refs > 0:
                return
            PROCESS.state = None
            teardown(state)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        s = self._state
        if s is None:
            return "Runtime(released)"
        return (
            f"Runtime(rank={s.rank}, world_size={s.world_size}, device={s.device}, "
            f"backend={s.backend!r}, nvshmem={s.nvshmem}, refs={s.refs}"
            + (", broken" if s.broken is not None else "")
            + ")"
        )

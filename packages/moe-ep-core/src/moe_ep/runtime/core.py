"""The runtime handle, `acquire`, and the process-wide ref-counted state under it.

`acquire(config)` returns a `Runtime` handle; the state underneath is process-wide and
ref-counted, so a layer, a backend and a test can each hold a handle. The last `release()`
tears down only what moe-ep created, as barrier -> destroy -> barrier. Every wait (rendezvous,
barriers, teardown) is bounded by `BootstrapConfig.timeout_s` (default MOE_EP_TIMEOUT_S, else
120 s): a dead peer becomes a `MoeEpTimeoutError` / `MoeEpPeerError` naming the rank, never a
hang.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from moe_ep import env as _env
from moe_ep.config import BootstrapConfig
from moe_ep.contract import RuntimeRequirements
from moe_ep.device import DeviceResolution, resolve_device_detailed, warn_if_host_bound_elsewhere
from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError, MoeEpUnavailableError, MoeEpUsageError
from moe_ep.runtime.bounded import BoundedStore, StoreLost, call_with_deadline, grace_s
from moe_ep.runtime.faults import WHAT_TO_DO, FaultBoard
from moe_ep.runtime.keys import Keys, new_token
from moe_ep.runtime.nvshmem_init import (
    finalize_nvshmem,
    init_nvshmem,
    nvshmem_unavailable_reason,
)
from moe_ep.runtime.store import create_store, host_store, store_barrier, world_size_claims
from moe_ep.runtime.waits import wait_work


@dataclass
class _State:
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


_lock = threading.RLock()
_state: _State | None = None
_lifetimes = 0  # torch.distributed bootstraps moe-ep has done in this process
_abandoned: str | None = None  # why an earlier bootstrap left torch.distributed unusable


def active_refcount() -> int:
    """How many unreleased `Runtime` handles this process holds (0 = no runtime state)."""
    with _lock:
        return 0 if _state is None else _state.refs


def _state_of(group: Any) -> _State | None:
    state = _state
    return state if state is not None and state.group is group else None


def bounded_wait(group: Any, work: Any, *, what: str) -> None:
    """Wait for `work` (posted `async_op=True` on `group`) within the active runtime's
    timeout; a failure raises the verdict every survivor raises (`MoeEpPeerError` /
    `MoeEpTimeoutError` with `failed_ranks`) and breaks the runtime. A group moe-ep does
    not manage is waited for plainly."""
    state = _state_of(group)
    if state is None:
        work.wait()
        return
    state.wait(work, what)


def report_local_failure(group: Any, exc: BaseException, *, what: str) -> None:
    """This rank raised `exc` where its peers on `group` wait in (or will reach) a
    collective: write it on the fault board so they fail at once naming this rank and
    its reason; the runtime is broken from now on. No-op at world size 1."""
    state = _state_of(group)
    if state is not None:
        state.fail_locally(exc, what)


def _check_group(group: Any, config: BootstrapConfig, what: str) -> None:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != config.world_size or rank != config.rank:
        raise MoeEpUsageError(
            f"{what} has world size {size} and this process is its rank {rank}, but "
            f"BootstrapConfig says world_size={config.world_size}, rank={config.rank}"
        )


# ---------------------------------------------------------------- handle


class Runtime:
    """A handle on the process-wide runtime; `release()` it (or use `with`).

    Attributes (valid until released): `rank`, `world_size`, `group` (the EP
    `torch.distributed.ProcessGroup`), `device` (`cuda:N` or `cpu`), `backend` ("gloo" or
    "nccl"), `timeout` (bound on every wait), `nvshmem` (NVSHMEM initialised), `failure`
    (None, or the error that broke the group).

    `__del__` is deliberately not used for release: teardown is collective, and a garbage
    collector running at different times on different ranks would hang or kill peers.
    """

    def __init__(self, state: _State) -> None:
        self._state: _State | None = state

    def _live(self) -> _State:
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
        _barrier(state, "moe-ep barrier")

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
        global _state
        with _lock:
            state, self._state = self._state, None
            if state is None:
                return
            state.refs -= 1
            if state.refs > 0:
                return
            _state = None
            _teardown(state)

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


def _store_barrier(state: _State, name: str, what: str, **kwargs: Any) -> None:
    assert state.store is not None and state.board is not None
    try:
        store_barrier(
            state.store,
            name,
            keys=state.keys,
            board=state.board,
            rank=state.rank,
            world_size=state.world_size,
            timeout_s=state.timeout_s,
            what=what,
            **kwargs,
        )
    except MoeEpPeerError as exc:
        state.mark_broken(exc)
        raise


def _barrier(state: _State, what: str) -> None:
    if state.store is not None:
        with state.lock:
            state.barrier_gen += 1
            gen = state.barrier_gen
        _store_barrier(state, f"barrier/{gen}", what)
        return
    # No store reachable (a host group torch hides it for): use the group itself.
    try:
        if state.backend == "gloo":
            dist.monitored_barrier(state.group, timeout=state.timeout, wait_all_ranks=True)
            return
        work = dist.barrier(group=state.group, async_op=True)
    except Exception as exc:
        error = MoeEpTimeoutError(
            f"{what}: not every rank arrived within {state.timeout_s:g} s (world size "
            f"{state.world_size}, seen from rank {state.rank}): {exc}; {WHAT_TO_DO}"
        )
        state.mark_broken(error)
        raise error from exc
    state.wait(work, what)


_GROUP_SHUTDOWN_S = 2.0
"""How long a broken runtime's teardown waits for torch to drop its process group."""


def _destroy_group_locally() -> None:
    """`destroy_process_group` without waiting on peers: torch joins the group's worker
    threads, which block until an abandoned collective's own timeout (gloo's default is 30
    minutes), so it runs on a daemon thread; torch.distributed is uninitialised before that
    join, so this process can bootstrap again at once."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(TimeoutError):
        call_with_deadline(dist.destroy_process_group, _GROUP_SHUTDOWN_S, "destroying the group")


def _linger_and_close(state: _State) -> None:
    """Stop using the store; its host first waits (at most `grace`) for the peers still
    reading a verdict from it."""
    if state.board is not None and state.store is not None and state.store.host_rank == state.rank:
        state.board.linger(time.monotonic() + state.board.grace)
    if state.store is not None:
        state.store.close()
    state.store = state.board = None


def _teardown_broken(state: _State) -> None:
    """Local teardown of a broken runtime: no barrier, no collective, bounded."""
    _linger_and_close(state)
    if state.created_group:
        _destroy_group_locally()
    state.group = None


def _teardown(state: _State) -> None:
    if state.broken is not None:
        _teardown_broken(state)
        return
    errors: list[BaseException] = []
    if state.created_nvshmem:
        try:
            _barrier(state, "moe-ep teardown (before NVSHMEM finalize)")
            finalize_nvshmem()
        except BaseException as exc:
            errors.append(exc)
    if state.created_group:
        try:
            if not errors:
                _store_barrier(
                    state, "teardown/enter", "moe-ep teardown (before destroying the process group)"
                )
        except BaseException as exc:
            errors.append(exc)
        finally:
            # Destroy locally even when a peer is gone, so this process is usable again.
            if errors:
                _destroy_group_locally()
            elif dist.is_initialized():
                dist.destroy_process_group()
        if not errors:
            try:
                _store_barrier(
                    state,
                    "teardown/exit",
                    "moe-ep teardown (after destroying the process group)",
                    host_waits_for_exit=True,
                )
            except BaseException as exc:
                errors.append(exc)
    _linger_and_close(state)
    state.group = None
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- acquire


def _start_nvshmem(state: _State) -> None:
    init_nvshmem(
        group=state.group,
        rank=state.rank,
        world_size=state.world_size,
        device=state.device,
        broadcast=lambda data: _broadcast_bytes(state, data, "moe-ep NVSHMEM init"),
    )
    state.nvshmem = state.created_nvshmem = True


def _check_compatible(state: _State, config: BootstrapConfig, res: DeviceResolution) -> None:
    problems = []
    if (config.world_size, config.rank) != (state.world_size, state.rank):
        problems.append(
            f"world_size={config.world_size}, rank={config.rank} vs the active "
            f"world_size={state.world_size}, rank={state.rank}"
        )
    if config.process_group is not None and config.process_group is not state.host_group:
        problems.append("a different process_group than the active runtime's")
    want = "cpu" if res.ordinal is None else f"cuda:{res.ordinal}"
    if want != str(state.device):
        problems.append(f"device {want} vs the active {state.device}")
    if problems:
        raise MoeEpUsageError(
            "acquire(): a moe-ep runtime is already active in this process with another "
            "config (" + "; ".join(problems) + "); release every handle first"
        )
    state.check_usable("acquire()")


def acquire(config: BootstrapConfig, *, requirements: RuntimeRequirements | None = None) -> Runtime:
    """Join (or create) the process-wide runtime and return a handle on it.

    The first acquire in a process binds the CUDA device (`resolve_local_device`), then
    reuses `config.process_group` or an initialised default group (never destroying it),
    else initialises torch.distributed itself: rendezvous at `config.init_method`
    ("tcp://HOST:PORT") or, when MASTER_ADDR/MASTER_PORT are set, there (env://); at world
    size 1 with neither, over a local in-process store (no network); gloo on CPU and under
    MEGA_SINGLE_GPU_GLOO=1, NCCL with `device_id` on CUDA. Rank 0 then shares a random run
    token over the group, which seals the store keys of barriers and fault reports.
    NVSHMEM is initialised only when `requirements.nvshmem`. Later acquires with the same
    config share that state (ref-counted).

    Raises:
        MoeEpUsageError: bad config, no way to rendezvous (world size > 1 with neither
            init_method nor MASTER_ADDR/MASTER_PORT), a rendezvous host that does not
            resolve, ranks that disagree on the world size, a group whose size/rank
            disagrees with the config, or auto_bootstrap=False without an initialised group.
        MoeEpUnavailableError: requirements this machine cannot meet (raised before any
            collective, so no peer hangs on this rank).
        MoeEpTimeoutError / MoeEpPeerError: a peer did not arrive or died (names the rank),
            or the active runtime is broken.
    """
    global _state
    if not isinstance(config, BootstrapConfig):
        raise MoeEpUsageError(
            f"config must be a moe_ep.BootstrapConfig, got {config!r} ({type(config).__name__})"
        )
    reqs = RuntimeRequirements() if requirements is None else requirements
    if not isinstance(reqs, RuntimeRequirements):
        raise MoeEpUsageError(
            f"requirements must be a RuntimeRequirements or None, got {requirements!r}"
        )
    res = resolve_device_detailed(config)
    timeout_s = config.effective_timeout_s()
    fold = _env.single_gpu_gloo()
    if reqs.cuda and res.ordinal is None:
        raise MoeEpUnavailableError(
            f"this kernel needs a CUDA device but none is visible on rank {config.rank} "
            f"(CUDA_VISIBLE_DEVICES={_env.cuda_visible_devices()})"
        )
    if reqs.nvshmem:
        reason = nvshmem_unavailable_reason(res)
        if reason is not None:
            raise MoeEpUnavailableError(f"this kernel needs NVSHMEM, unavailable: {reason}")
    with _lock:
        if _state is not None:
            _check_compatible(_state, config, res)
            if reqs.nvshmem and not _state.nvshmem:
                _start_nvshmem(_state)
            _state.refs += 1
            return Runtime(_state)
        if _abandoned is not None:
            raise MoeEpPeerError(
                f"acquire(): {_abandoned}; torch.distributed in this process may still "
                "complete it at any time, so moe-ep cannot bootstrap again: restart the process"
            )
        state = _bootstrap(config, res, timeout_s, fold)
        try:
            if reqs.nvshmem:
                _start_nvshmem(state)
        except BaseException:
            _teardown(state)
            raise
        state.refs = 1
        _state = state
        return Runtime(state)


def _bind_device(config: BootstrapConfig, res: DeviceResolution) -> torch.device:
    if res.ordinal is None:
        return torch.device("cpu")
    # torch cannot tell "the host chose device 0" from "nothing chosen yet" (both read
    # 0), so a host binding is recognised when CUDA is initialised or a non-0 is current.
    was_initialised = torch.cuda.is_initialized()
    current = torch.cuda.current_device()
    host_bound = current if (was_initialised or current != 0) else None
    warn_if_host_bound_elsewhere(config, res, host_bound)
    torch.cuda.set_device(res.ordinal)
    return torch.device("cuda", res.ordinal)


def _broadcast_bytes(state: _State, data: bytes, what: str) -> bytes:
    """Collective: group rank 0's `data` on every rank (lengths, then bytes), each wait
    bounded by `state.wait`."""
    src = dist.get_global_rank(state.group, 0)
    size = torch.tensor([len(data)], dtype=torch.int64, device=state.device)
    state.wait(dist.broadcast(size, src=src, group=state.group, async_op=True), what)
    buf = torch.zeros(int(size.item()), dtype=torch.uint8)
    if state.rank == 0:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(state.device)
    state.wait(dist.broadcast(buf, src=src, group=state.group, async_op=True), what)
    return bytes(buf.cpu().tolist())


def _seal(state: _State) -> None:
    """Rank 0's fresh run token to every rank over the group (never through the store),
    then the sealed key scheme and fault board of this lifetime."""
    token = new_token() if state.rank == 0 else b""
    if state.world_size > 1:
        token = _broadcast_bytes(state, token, "moe-ep bootstrap (sharing the run token)")
    state.keys = Keys("rt", token)
    if state.store is not None:
        state.board = FaultBoard(
            state.store,
            state.keys.child("fault"),
            rank=state.rank,
            world_size=state.world_size,
            timeout_s=state.timeout_s,
        )


def _boot_board(store: BoundedStore, keys: Keys, config: BootstrapConfig, t: float) -> FaultBoard:
    return FaultBoard(
        store, keys.child("fault"), rank=config.rank, world_size=config.world_size, timeout_s=t
    )


def _bootstrap(
    config: BootstrapConfig, res: DeviceResolution, timeout_s: float, fold: bool
) -> _State:
    device = _bind_device(config, res)
    timeout = datetime.timedelta(seconds=timeout_s)
    boot = Keys("boot")  # unsealed: there is no token before the group exists
    if config.process_group is not None or dist.is_initialized():
        if config.process_group is not None:
            if not isinstance(config.process_group, dist.ProcessGroup):
                raise MoeEpUsageError(
                    "BootstrapConfig.process_group must be a torch.distributed.ProcessGroup, "
                    f"got {type(config.process_group).__name__}"
                )
            group, what = config.process_group, "BootstrapConfig.process_group"
        else:
            group, what = dist.group.WORLD, "the host's default process group"  # type: ignore[assignment]
        _check_group(group, config, what)
        store = host_store(group)
        state = _State(
            rank=config.rank,
            world_size=config.world_size,
            group=group,
            device=device,
            backend=str(dist.get_backend(group)),
            timeout=timeout,
            created_group=False,
            store=store,
            keys=boot,
            board=None if store is None else _boot_board(store, boot, config, timeout_s),
            host_group=config.process_group,
        )
        try:
            if store is not None and config.world_size > 1:
                _store_barrier(state, "joined", "moe-ep acquire (on the host's group)")
            _seal(state)
        except BaseException:
            _linger_and_close(state)
            raise
        return state
    if not config.auto_bootstrap:
        raise MoeEpUsageError(
            "BootstrapConfig.auto_bootstrap=False but torch.distributed is not initialised and "
            "no process_group was given; initialise torch.distributed in the host first or "
            "set auto_bootstrap=True"
        )
    backend = "gloo" if res.ordinal is None or fold else "nccl"
    global _lifetimes, _abandoned
    _lifetimes += 1  # every rank counts its bootstraps alike: the store is namespaced by it
    start = time.monotonic()
    store = create_store(config, timeout_s, _lifetimes)
    state = _State(
        rank=config.rank,
        world_size=config.world_size,
        group=None,
        device=device,
        backend=backend,
        timeout=timeout,
        created_group=True,
        store=store,
        keys=boot,
        board=_boot_board(store, boot, config, timeout_s),
    )
    assert state.board is not None
    try:
        claims = world_size_claims(store, boot, config, start + timeout_s)
        _store_barrier(state, "bootstrap", "moe-ep bootstrap", on_poll=claims)
    except StoreLost as lost:
        store.close()
        raise state.board.lost_verdict(lost).error(
            "moe-ep bootstrap", rank=config.rank, world_size=config.world_size, timeout_s=timeout_s
        ) from lost
    except MoeEpUsageError as exc:
        state.fail_locally(exc, "moe-ep bootstrap")
        _linger_and_close(state)
        raise
    except BaseException:
        _linger_and_close(state)
        raise
    # torch's rendezvous inside init_process_group does not bound its store calls either
    group_timeout = datetime.timedelta(seconds=timeout_s + 2 * grace_s(timeout_s))

    def init_group() -> None:
        if device.type == "cuda":  # the current device is per thread
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("moe_ep/pg", store.raw),
            rank=config.rank,
            world_size=config.world_size,
            timeout=group_timeout,
            device_id=device if backend == "nccl" else None,
        )

    try:
        call_with_deadline(init_group, timeout_s, "creating the process group")
    except TimeoutError as exc:
        _abandoned = (
            f"an earlier bootstrap abandoned creating its {backend} process group after "
            f"{timeout_s:g} s"
        )
        raise state.board.agree("timeout").error(
            f"moe-ep bootstrap (creating the {backend} process group)",
            rank=config.rank,
            world_size=config.world_size,
            timeout_s=timeout_s,
        ) from exc
    except Exception as exc:
        store.close()
        raise MoeEpPeerError(
            f"moe-ep bootstrap: creating the {backend} process group failed on rank "
            f"{config.rank} of world size {config.world_size} (timeout {timeout_s:g} s): {exc}"
        ) from exc
    state.group = dist.group.WORLD
    try:
        _store_barrier(state, "bootstrap_done", "moe-ep bootstrap (group created)")
        _seal(state)
    except BaseException:
        _teardown_broken(state)
        raise
    return state

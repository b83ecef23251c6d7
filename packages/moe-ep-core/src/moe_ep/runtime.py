"""Runtime bootstrap: bind the device, join (or create) the EP process group, NVSHMEM.

`acquire(config)` returns a `Runtime` handle; the state underneath is process-wide and
ref-counted, so a layer, a backend and a test can each hold a handle. The last `release()`
tears down only what moe-ep created, as barrier -> destroy -> barrier. Every wait (rendezvous,
barriers, teardown) is bounded by `BootstrapConfig.timeout_s` (default MOE_EP_TIMEOUT_S, else
120 s): a dead peer becomes a `MoeEpTimeoutError` / `MoeEpPeerError` naming the rank, never a
hang. This module imports no backend and no drop.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import socket
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from moe_ep import env as _env
from moe_ep.backends.base import RuntimeRequirements
from moe_ep.config import BootstrapConfig
from moe_ep.device import DeviceResolution, resolve_device_detailed, warn_if_host_bound_elsewhere
from moe_ep.errors import (
    MoeEpPeerError,
    MoeEpTimeoutError,
    MoeEpUnavailableError,
    MoeEpUsageError,
)

__all__ = ["Runtime", "acquire", "active_refcount"]

_STORE_HOST = 0  # group rank hosting the TCPStore moe-ep creates


@dataclass
class _State:
    rank: int
    world_size: int
    group: Any
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    created_group: bool
    store: Any  # our rendezvous TCPStore when created_group, else the host's default store
    store_prefix: str
    store_host_desc: str
    refs: int = 0
    nvshmem: bool = False
    created_nvshmem: bool = False
    host_group: Any = None
    barrier_gen: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_lock = threading.RLock()
_state: _State | None = None


def active_refcount() -> int:
    """How many unreleased `Runtime` handles this process holds (0 = no runtime state)."""
    with _lock:
        return 0 if _state is None else _state.refs


# ---------------------------------------------------------------- bounded store barrier


def _missing(store: Any, prefix: str, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not store.check([f"{prefix}/arrived/{r}"])]


def _store_barrier(
    store: Any,
    prefix: str,
    *,
    rank: int,
    world_size: int,
    timeout_s: float,
    what: str,
    host_desc: str,
    host_waits_for_exit: bool = False,
) -> None:
    """All `world_size` ranks meet under `prefix` in `store`, or raise within `timeout_s`.

    Group rank 0 decides a timeout: it writes which ranks are missing under `abort` and waits
    briefly for the ranks that did arrive to read it, so every survivor reports the same
    missing ranks (instead of racing the store's shutdown). Others give up on their own
    only a grace period later (rank 0 itself is then the one missing).

    Raises:
        MoeEpTimeoutError: names the ranks that did not arrive, world size and timeout.
        MoeEpPeerError: the store (hosted by a peer) went away; names that peer.
    """
    start = time.monotonic()
    grace = min(2.0, 0.25 * timeout_s + 0.1)
    decider = rank == 0

    def fail(detail: str) -> MoeEpTimeoutError:
        return MoeEpTimeoutError(
            f"{what}: {detail}; world size {world_size}, timeout {timeout_s:g} s, "
            f"seen from rank {rank}"
        )

    try:
        store.set(f"{prefix}/arrived/{rank}", b"1")
        if store.add(f"{prefix}/count", 1) == world_size:
            store.set(f"{prefix}/done", b"1")
        pause = 0.0005
        while not store.check([f"{prefix}/done"]):
            if store.check([f"{prefix}/abort"]):
                detail = store.get(f"{prefix}/abort").decode()
                store.add(f"{prefix}/abort_ack", 1)
                raise fail(detail)
            waited = time.monotonic() - start
            if decider and waited > timeout_s:
                missing = _missing(store, prefix, world_size)
                if not missing:
                    continue  # the last rank arrived just now
                detail = (
                    f"rank(s) {missing} did not arrive ({world_size - len(missing)}/"
                    f"{world_size} did)"
                )
                store.set(f"{prefix}/abort", detail.encode())
                others = world_size - len(missing) - 1
                until = time.monotonic() + grace
                while store.add(f"{prefix}/abort_ack", 0) < others and time.monotonic() < until:
                    time.sleep(0.01)
                raise fail(detail)
            if not decider and waited > timeout_s + grace:
                missing = _missing(store, prefix, world_size)
                raise fail(f"rank(s) {missing} did not arrive (rank 0 did not decide in time)")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
    except MoeEpTimeoutError:
        raise
    except Exception as exc:
        raise MoeEpPeerError(
            f"{what}: rank {rank} lost the rendezvous store hosted by {host_desc} "
            f"(world size {world_size}); that rank probably died: {exc}"
        ) from exc
    if not host_waits_for_exit:
        return
    if rank != _STORE_HOST:
        # The host may be gone already; nothing is left to coordinate then.
        with contextlib.suppress(Exception):
            if store.add(f"{prefix}/left", 1) == world_size - 1:
                store.set(f"{prefix}/all_left", b"1")
    elif world_size > 1:
        remaining = max(0.001, start + timeout_s - time.monotonic())
        # Everyone arrived; a rank that vanished since cannot be waited for.
        with contextlib.suppress(Exception):
            store.wait([f"{prefix}/all_left"], datetime.timedelta(seconds=remaining))


# ---------------------------------------------------------------- rendezvous


def _rendezvous_url(config: BootstrapConfig) -> tuple[str, int]:
    if config.init_method is not None:
        parsed = urlparse(config.init_method)
        if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
            raise MoeEpUsageError(
                "BootstrapConfig.init_method must be 'tcp://HOST:PORT' (moe-ep hosts the "
                f"store itself), got {config.init_method!r}"
            )
        return parsed.hostname, parsed.port
    addr_port = _env.master_addr_port()
    if addr_port is None:
        raise MoeEpUsageError(
            "torch.distributed is not initialised and moe-ep cannot initialise it: "
            "set MASTER_ADDR and MASTER_PORT (torchrun does), pass "
            "BootstrapConfig(init_method='tcp://HOST:PORT'), or initialise "
            "torch.distributed in the host and pass process_group="
        )
    env_rank, env_world = _env.torchrun_rank(), _env.torchrun_world_size()
    if env_world is not None and env_world != config.world_size:
        raise MoeEpUsageError(
            f"BootstrapConfig.world_size={config.world_size} disagrees with environment "
            f"variable WORLD_SIZE={env_world}"
        )
    if env_rank is not None and env_rank != config.rank:
        raise MoeEpUsageError(
            f"BootstrapConfig.rank={config.rank} disagrees with environment variable "
            f"RANK={env_rank}"
        )
    return addr_port


def _port_open(host: str, port: int, deadline: float) -> bool:
    """Poll until something listens on host:port (torch's own connect loop can take about
    twice its timeout, so the bounded wait is done here)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


_CLOSING_KEY = "moe_ep/closing"  # set in a store moe-ep is about to close


def _create_store(config: BootstrapConfig, timeout_s: float) -> tuple[Any, str]:
    """Host (rank 0) or join the rendezvous TCPStore, within `timeout_s`.

    A rank that bootstraps again right after a teardown can reach the previous store on the
    same port before rank 0 has closed it; such a store carries `_CLOSING_KEY`, and the rank
    drops it and retries until rank 0's new store answers.
    """
    host, port = _rendezvous_url(config)
    desc = f"rank {_STORE_HOST} at {host}:{port}"
    deadline = time.monotonic() + timeout_s
    is_host = config.rank == _STORE_HOST
    last_error: BaseException | None = None
    while True:
        if not is_host and not _port_open(host, port, deadline):
            break
        timeout = datetime.timedelta(seconds=max(0.5, deadline - time.monotonic()))
        try:
            store = dist.TCPStore(
                host, port, config.world_size, is_host, timeout, wait_for_workers=False
            )
            if is_host or not store.check([_CLOSING_KEY]):
                return store, desc
            del store
        except Exception as exc:
            if is_host:
                raise MoeEpPeerError(
                    f"bootstrap: rank 0 could not host the rendezvous store on {host}:{port}: {exc}"
                ) from exc
            last_error = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    raise MoeEpTimeoutError(
        f"bootstrap: rank(s) [0] did not arrive: rank {config.rank} could not reach the "
        f"rendezvous store hosted by {desc} within {timeout_s:g} s (world size "
        f"{config.world_size})" + (f": {last_error}" if last_error else "")
    ) from last_error


def _check_group(group: Any, config: BootstrapConfig, what: str) -> None:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != config.world_size or rank != config.rank:
        raise MoeEpUsageError(
            f"{what} has world size {size} and this process is its rank {rank}, but "
            f"BootstrapConfig says world_size={config.world_size}, rank={config.rank}"
        )


_host_lifetimes: dict[str, int] = {}  # group tag -> runtimes bootstrapped on it so far


def _host_store(group: Any) -> tuple[Any, str]:
    """The host's default store, namespaced for this group and this runtime lifetime (the
    host's store outlives us, so barrier keys of an earlier lifetime must not be reused);
    None if torch hides it."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None, ""
    ranks = dist.get_process_group_ranks(group)
    tag = hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]
    life = _host_lifetimes[tag] = _host_lifetimes.get(tag, 0) + 1
    prefix = f"moe_ep/group-{tag}/life-{life}"
    return dist.PrefixStore(prefix, store), "the host's default store"


# ---------------------------------------------------------------- NVSHMEM


def _nvshmem_unavailable_reason(device: DeviceResolution) -> str | None:
    if device.ordinal is None:
        return "no CUDA device is visible (NVSHMEM needs a GPU)"
    try:
        import nvshmem.core  # noqa: F401
    except Exception as exc:
        return (
            f"nvshmem4py could not be imported ({type(exc).__name__}: {exc}); install the "
            "moe-ep sm90/sm100 extra"
        )
    return None


def _init_nvshmem(state: _State) -> None:
    """Initialise NVSHMEM over the EP group with a unique id made on group rank 0.

    Warning: never run on a GPU in this project's CI (no GPU there); written against
    nvshmem4py 0.4's `get_unique_id` / `init(initializer_method="uid")`.
    """
    import nvshmem.core as nvshmem

    try:
        from cuda.core import Device
    except ImportError:  # older cuda-core
        from cuda.core.experimental import Device

    dev = Device(state.device.index)
    dev.set_current()
    uid = nvshmem.get_unique_id(empty=state.rank != 0)
    box = [uid]
    src = dist.get_global_rank(state.group, 0) if state.group is not None else 0
    dist.broadcast_object_list(box, src=src, group=state.group)
    nvshmem.init(
        device=dev, uid=box[0], rank=state.rank, nranks=state.world_size, initializer_method="uid"
    )
    state.nvshmem = state.created_nvshmem = True


# ---------------------------------------------------------------- handle


class Runtime:
    """A handle on the process-wide runtime; `release()` it (or use `with`).

    Attributes (valid until released): `rank`, `world_size`, `group` (the EP
    `torch.distributed.ProcessGroup`), `device` (`cuda:N` or `cpu`), `backend` ("gloo" or
    "nccl"), `timeout` (bound on every wait), `nvshmem` (NVSHMEM initialised).

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

    def barrier(self) -> None:
        """Collective: every EP rank meets here, bounded by `timeout`.

        Raises:
            MoeEpTimeoutError: names the ranks that did not arrive, the world size and the
                timeout.
        """
        _barrier(self._live(), "moe-ep barrier")

    def release(self) -> None:
        """Drop this handle; idempotent. The last release tears down what moe-ep created
        (collective then: barrier -> destroy -> barrier, each bounded by `timeout`)."""
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
            f"backend={s.backend!r}, nvshmem={s.nvshmem}, refs={s.refs})"
        )


def _barrier(state: _State, what: str) -> None:
    timeout_s = state.timeout.total_seconds()
    if state.store is not None:
        with state.lock:
            state.barrier_gen += 1
            gen = state.barrier_gen
        _store_barrier(
            state.store,
            f"{state.store_prefix}/barrier/{gen}",
            rank=state.rank,
            world_size=state.world_size,
            timeout_s=timeout_s,
            what=what,
            host_desc=state.store_host_desc,
        )
        return
    # No store reachable (a host group torch hides it for): use the group itself.
    try:
        if state.backend == "gloo":
            dist.monitored_barrier(state.group, timeout=state.timeout, wait_all_ranks=True)
        else:
            work = dist.barrier(group=state.group, async_op=True)
            if not work.wait(state.timeout):
                raise RuntimeError("barrier did not complete")
    except Exception as exc:
        raise MoeEpTimeoutError(
            f"{what}: not every rank arrived within {timeout_s:g} s (world size "
            f"{state.world_size}, seen from rank {state.rank}): {exc}"
        ) from exc


def _teardown(state: _State) -> None:
    errors: list[BaseException] = []
    if state.created_nvshmem:
        try:
            _barrier(state, "moe-ep teardown (before NVSHMEM finalize)")
            import nvshmem.core as nvshmem

            nvshmem.finalize()
        except BaseException as exc:
            errors.append(exc)
    if state.created_group:
        timeout_s = state.timeout.total_seconds()
        common: dict[str, Any] = {
            "rank": state.rank,
            "world_size": state.world_size,
            "timeout_s": timeout_s,
            "host_desc": state.store_host_desc,
        }
        try:
            if not errors:
                _store_barrier(
                    state.store,
                    f"{state.store_prefix}/teardown/enter",
                    what="moe-ep teardown (before destroying the process group)",
                    **common,
                )
        except BaseException as exc:
            errors.append(exc)
        finally:
            # Destroy locally even when a peer is gone, so this process is usable again.
            if dist.is_initialized():
                dist.destroy_process_group()
        if not errors:
            # Before anyone can leave the last barrier and bootstrap again on this port.
            with contextlib.suppress(Exception):  # a dead store fails the barrier below
                state.store.set(_CLOSING_KEY, b"1")
            try:
                _store_barrier(
                    state.store,
                    f"{state.store_prefix}/teardown/exit",
                    what="moe-ep teardown (after destroying the process group)",
                    host_waits_for_exit=True,
                    **common,
                )
            except BaseException as exc:
                errors.append(exc)
    state.store = state.group = None
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- acquire


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


def acquire(config: BootstrapConfig, *, requirements: RuntimeRequirements | None = None) -> Runtime:
    """Join (or create) the process-wide runtime and return a handle on it.

    The first acquire in a process binds the CUDA device (`resolve_local_device`), then
    reuses `config.process_group` or an initialised default group (never destroying it),
    else initialises torch.distributed itself: rendezvous at `config.init_method`
    ("tcp://HOST:PORT") or, when MASTER_ADDR/MASTER_PORT are set, there (env://); gloo on
    CPU and under MEGA_SINGLE_GPU_GLOO=1, NCCL with `device_id` on CUDA. NVSHMEM is
    initialised only when `requirements.nvshmem`. Later acquires with the same config share
    that state (ref-counted).

    Raises:
        MoeEpUsageError: bad config, no way to rendezvous, a group whose size/rank disagrees
            with the config, or auto_bootstrap=False without an initialised group.
        MoeEpUnavailableError: requirements this machine cannot meet (raised before any
            collective, so no peer hangs on this rank).
        MoeEpTimeoutError / MoeEpPeerError: a peer did not arrive or died; names the rank.
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
        reason = _nvshmem_unavailable_reason(res)
        if reason is not None:
            raise MoeEpUnavailableError(f"this kernel needs NVSHMEM, unavailable: {reason}")
    with _lock:
        if _state is not None:
            _check_compatible(_state, config, res)
            if reqs.nvshmem and not _state.nvshmem:
                _init_nvshmem(_state)
            _state.refs += 1
            return Runtime(_state)
        state = _bootstrap(config, res, timeout_s, fold)
        try:
            if reqs.nvshmem:
                _init_nvshmem(state)
        except BaseException:
            _teardown(state)
            raise
        state.refs = 1
        _state = state
        return Runtime(state)


def _bootstrap(
    config: BootstrapConfig, res: DeviceResolution, timeout_s: float, fold: bool
) -> _State:
    if res.ordinal is not None:
        current = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        warn_if_host_bound_elsewhere(config, res, current)
        torch.cuda.set_device(res.ordinal)
        device = torch.device("cuda", res.ordinal)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=timeout_s)
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
        store, host_desc = _host_store(group)
        return _State(
            rank=config.rank,
            world_size=config.world_size,
            group=group,
            device=device,
            backend=str(dist.get_backend(group)),
            timeout=timeout,
            created_group=False,
            store=store,
            store_prefix="moe_ep",
            store_host_desc=host_desc,
            host_group=config.process_group,
        )
    if not config.auto_bootstrap:
        raise MoeEpUsageError(
            "BootstrapConfig.auto_bootstrap=False but torch.distributed is not initialised and "
            "no process_group was given; initialise torch.distributed in the host first or "
            "set auto_bootstrap=True"
        )
    backend = "gloo" if res.ordinal is None or fold else "nccl"
    store, host_desc = _create_store(config, timeout_s)
    common: dict[str, Any] = {
        "rank": config.rank,
        "world_size": config.world_size,
        "timeout_s": timeout_s,
    }
    _store_barrier(
        store, "moe_ep/bootstrap", what="moe-ep bootstrap", host_desc=host_desc, **common
    )
    try:
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("moe_ep/pg", store),
            rank=config.rank,
            world_size=config.world_size,
            timeout=timeout,
            device_id=device if backend == "nccl" else None,
        )
    except Exception as exc:
        raise MoeEpPeerError(
            f"moe-ep bootstrap: creating the {backend} process group failed on rank "
            f"{config.rank} of world size {config.world_size} (timeout {timeout_s:g} s): {exc}"
        ) from exc
    state = _State(
        rank=config.rank,
        world_size=config.world_size,
        group=dist.group.WORLD,
        device=device,
        backend=backend,
        timeout=timeout,
        created_group=True,
        store=store,
        store_prefix="moe_ep",
        store_host_desc=host_desc,
    )
    try:
        _store_barrier(
            store,
            "moe_ep/bootstrap_done",
            what="moe-ep bootstrap (group created)",
            host_desc=host_desc,
            **common,
        )
    except BaseException:
        dist.destroy_process_group()
        raise
    return state

"""The runtime handle, `acquire`, and the process-wide ref-counted state under it.

`acquire(config)` returns a `Runtime` handle; the state underneath is process-wide and
ref-counted, so a layer, a backend and a test can each hold a handle. The last `release()`
tears down only what moe-ep created, as barrier -> destroy -> barrier. Every wait (rendezvous,
barriers, teardown) is bounded by `BootstrapConfig.timeout_s` (default MOE_EP_TIMEOUT_S, else
120 s): a dead peer becomes a `MoeEpTimeoutError` / `MoeEpPeerError` naming the rank, never a
hang.
"""

from __future__ import annotations

import datetime
import json
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from moe_ep import env as _env
from moe_ep.backends.base import RuntimeRequirements
from moe_ep.config import BootstrapConfig
from moe_ep.device import DeviceResolution, resolve_device_detailed, warn_if_host_bound_elsewhere
from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError, MoeEpUnavailableError, MoeEpUsageError
from moe_ep.runtime.nvshmem_init import (
    finalize_nvshmem,
    init_nvshmem,
    nvshmem_unavailable_reason,
)
from moe_ep.runtime.store import create_store, host_store, store_barrier


@dataclass
class _State:
    rank: int
    world_size: int
    group: Any
    device: torch.device
    backend: str
    timeout: datetime.timedelta
    created_group: bool
    store: Any  # ours when created_group (TCPStore; HashStore at world size 1), else the host's
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
_lifetimes = 0  # torch.distributed bootstraps moe-ep has done in this process


def active_refcount() -> int:
    """How many unreleased `Runtime` handles this process holds (0 = no runtime state)."""
    with _lock:
        return 0 if _state is None else _state.refs


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

    def gather_json(self, payload: Any, *, what: str) -> list[Any]:
        """Collective: every rank's JSON-able `payload` in rank order, bounded by `timeout`
        (`moe_ep.runtime.gather.gather_json`; world size 1 skips the collective).

        Raises:
            MoeEpTimeoutError: a rank did not arrive in time (names `what`).
        """
        state = self._live()
        if state.world_size == 1:
            return [json.loads(json.dumps(payload, sort_keys=True))]  # same form as gathered
        from moe_ep.runtime.gather import gather_json

        return gather_json(
            state.group, payload, device=state.device, timeout=state.timeout, what=what
        )

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
        store_barrier(
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
            finalize_nvshmem()
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
                store_barrier(
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
            try:
                store_barrier(
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


def _start_nvshmem(state: _State) -> None:
    init_nvshmem(
        group=state.group, rank=state.rank, world_size=state.world_size, device=state.device
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


def acquire(config: BootstrapConfig, *, requirements: RuntimeRequirements | None = None) -> Runtime:
    """Join (or create) the process-wide runtime and return a handle on it.

    The first acquire in a process binds the CUDA device (`resolve_local_device`), then
    reuses `config.process_group` or an initialised default group (never destroying it),
    else initialises torch.distributed itself: rendezvous at `config.init_method`
    ("tcp://HOST:PORT") or, when MASTER_ADDR/MASTER_PORT are set, there (env://); at world
    size 1 with neither, over a local in-process store (no network); gloo on CPU and under
    MEGA_SINGLE_GPU_GLOO=1, NCCL with `device_id` on CUDA. NVSHMEM is
    initialised only when `requirements.nvshmem`. Later acquires with the same config share
    that state (ref-counted).

    Raises:
        MoeEpUsageError: bad config, no way to rendezvous (world size > 1 with neither
            init_method nor MASTER_ADDR/MASTER_PORT), a group whose size/rank disagrees with
            the config, or auto_bootstrap=False without an initialised group.
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


def _bootstrap(
    config: BootstrapConfig, res: DeviceResolution, timeout_s: float, fold: bool
) -> _State:
    if res.ordinal is not None:
        # torch cannot tell "the host chose device 0" from "nothing chosen yet" (both read
        # 0), so a host binding is recognised when CUDA is initialised or a non-0 is current.
        was_initialised = torch.cuda.is_initialized()
        current = torch.cuda.current_device()
        host_bound = current if (was_initialised or current != 0) else None
        warn_if_host_bound_elsewhere(config, res, host_bound)
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
        store, host_desc = host_store(group)
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
    global _lifetimes
    _lifetimes += 1  # every rank counts its bootstraps alike: the store is namespaced by it
    store, host_desc = create_store(config, timeout_s, _lifetimes)
    common: dict[str, Any] = {
        "rank": config.rank,
        "world_size": config.world_size,
        "timeout_s": timeout_s,
    }
    store_barrier(store, "moe_ep/bootstrap", what="moe-ep bootstrap", host_desc=host_desc, **common)
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
        store_barrier(
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

"""`acquire`: join (or create) the process-wide runtime: bind the device, rendezvous, create
or adopt the EP group, seal the store keys, start NVSHMEM when asked.

Every wait (rendezvous, barriers, teardown) is bounded by `BootstrapConfig.timeout_s`
(default MOE_EP_TIMEOUT_S, else 120 s): a dead peer becomes a `MoeEpTimeoutError` /
`MoeEpPeerError` naming the rank, never a hang.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

from moe_ep import env as _env
from moe_ep.config import BootstrapConfig
from moe_ep.contract import RuntimeRequirements
from moe_ep.device import DeviceResolution, resolve_device_detailed, warn_if_host_bound_elsewhere
from moe_ep.errors import MoeEpPeerError, MoeEpUnavailableError, MoeEpUsageError
from moe_ep.runtime.bounded import BoundedStore, StoreLost, call_with_deadline, grace_s
from moe_ep.runtime.faults import FaultBoard
from moe_ep.runtime.handle import Runtime
from moe_ep.runtime.keys import Keys, new_token
from moe_ep.runtime.nvshmem_init import init_nvshmem, nvshmem_unavailable_reason
from moe_ep.runtime.state import PROCESS, RuntimeState
from moe_ep.runtime.store import create_store, host_store, world_size_claims
from moe_ep.runtime.teardown import linger_and_close, teardown, teardown_broken

__all__ = ["acquire"]


def _check_group(group: Any, config: BootstrapConfig, what: str) -> None:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != config.world_size or rank != config.rank:
        raise MoeEpUsageError(
            f"{what} has world size {size} and this process is its rank {rank}, but "
            f"BootstrapConfig says world_size={config.world_size}, rank={config.rank}"
        )


def _start_nvshmem(state: RuntimeState) -> None:
    init_nvshmem(
        group=state.group,
        rank=state.rank,
        world_size=state.world_size,
        device=state.device,
        broadcast=lambda data: _broadcast_bytes(state, data, "moe-ep NVSHMEM init"),
    )
    state.nvshmem = state.created_nvshmem = True


def _check_compatible(state: RuntimeState, config: BootstrapConfig, res: DeviceResolution) -> None:
    problems = []
    if (config.world_size, config.rank) != (state.world_size, state.rank):
        problems.append(
            f"world_size={config.world_size}, rank={config.rank} vs the active "
            f"world_size={state.world_size}, rank={state.rank}"
        )
    if config.process_group is not None and config.process_group is not state.host_group:
        problems.append("a different process_group than the active runtime's")
    if config.external_store and (state.store is None or state.store.host_rank is not None):
        problems.append("external_store=True vs the active runtime's store, which an EP rank hosts")
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
    ("tcp://HOST:PORT") or, when MASTER_ADDR/MASTER_PORT are set, there (env://), in a
    store rank 0 hosts unless `config.external_store` (or torchrun's agent) serves it; at
    world size 1 with neither, over a local in-process store (no network); gloo on CPU and
    under MEGA_SINGLE_GPU_GLOO=1, NCCL with `device_id` on CUDA. Rank 0 then shares a random run
    token over the group, which seals the store keys of barriers and fault reports.
    NVSHMEM is initialised only when `requirements.nvshmem`. Later acquires with the same
    config share that state (ref-counted).

    Raises:
        MoeEpUsageError: bad config, no way to rendezvous (world size > 1, or
            external_store, with neither init_method nor MASTER_ADDR/MASTER_PORT;
            external_store with a host-initialised group), a rendezvous host that does not
            resolve, ranks that disagree on the world size, a group whose size/rank
            disagrees with the config, or auto_bootstrap=False without an initialised group.
        MoeEpUnavailableError: requirements this machine cannot meet (raised before any
            collective, so no peer hangs on this rank).
        MoeEpTimeoutError / MoeEpPeerError: a peer did not arrive or died (names the rank),
            or the active runtime is broken.
    """
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
    with PROCESS.lock:
        active = PROCESS.state
        if active is not None:
            _check_compatible(active, config, res)
            if reqs.nvshmem and not active.nvshmem:
                _start_nvshmem(active)
            active.refs += 1
            return Runtime(active)
        if PROCESS.abandoned is not None:
            raise MoeEpPeerError(
                f"acquire(): {PROCESS.abandoned}; torch.distributed in this process may still "
                "complete it at any time, so moe-ep cannot bootstrap again: restart the process"
            )
        state = _bootstrap(config, res, timeout_s, fold)
        try:
            if reqs.nvshmem:
                _start_nvshmem(state)
        except BaseException:
            teardown(state)
            raise
        state.refs = 1
        PROCESS.state = state
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


def _broadcast_bytes(state: RuntimeState, data: bytes, what: str) -> bytes:
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


def _seal(state: RuntimeState) -> None:
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
) -> RuntimeState:
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
            if config.external_store:
                raise MoeEpUsageError(
                    "BootstrapConfig.external_store=True, but torch.distributed is already "
                    "initialised by the host: moe-ep uses its default group and store and "
                    "joins none; drop external_store or let moe-ep initialise the group"
                )
        _check_group(group, config, what)
        store = host_store(group)
        state = RuntimeState(
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
                state.store_barrier("joined", "moe-ep acquire (on the host's group)")
            _seal(state)
        except BaseException:
            linger_and_close(state)
            raise
        return state
    if not config.auto_bootstrap:
        raise MoeEpUsageError(
            "BootstrapConfig.auto_bootstrap=False but torch.distributed is not initialised and "
            "no process_group was given; initialise torch.distributed in the host first or "
            "set auto_bootstrap=True"
        )
    backend = "gloo" if res.ordinal is None or fold else "nccl"
    PROCESS.lifetimes += 1  # every rank counts its bootstraps alike: the store is namespaced by it
    start = time.monotonic()
    store = create_store(config, timeout_s, PROCESS.lifetimes)
    state = RuntimeState(
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
        state.store_barrier("bootstrap", "moe-ep bootstrap", on_poll=claims)
    except StoreLost as lost:
        store.close()
        raise state.board.lost_verdict(lost).error(
            "moe-ep bootstrap", rank=config.rank, world_size=config.world_size, timeout_s=timeout_s
        ) from lost
    except MoeEpUsageError as exc:
        state.fail_locally(exc, "moe-ep bootstrap")
        linger_and_close(state)
        raise
    except BaseException:
        linger_and_close(state)
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
        PROCESS.abandoned = (
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
        state.store_barrier("bootstrap_done", "moe-ep bootstrap (group created)")
        _seal(state)
    except BaseException:
        teardown_broken(state)
        raise
    return state

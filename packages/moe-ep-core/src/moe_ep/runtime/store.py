"""The rendezvous store moe-ep hosts, and barriers over a store that are bounded in time.

One process (world size 1) with no rendezvous configured gets a local in-process store.

Barriers run over a TCPStore rather than the process group: a dead peer then shows up as a
missing key, which names the rank, instead of a hung or aborted collective.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import socket
import time
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from moe_ep import env as _env
from moe_ep.config import BootstrapConfig
from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError, MoeEpUsageError

__all__ = [
    "LIFETIME_KEY",
    "LOCAL_STORE_DESC",
    "STORE_HOST",
    "create_store",
    "host_store",
    "port_open",
    "rendezvous_url",
    "store_barrier",
]

STORE_HOST = 0  # group rank hosting the TCPStore moe-ep creates
LOCAL_STORE_DESC = "this process's local store (world size 1, no rendezvous)"


# ---------------------------------------------------------------- bounded store barrier


def _missing(store: Any, prefix: str, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not store.check([f"{prefix}/arrived/{r}"])]


def store_barrier(
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

    The arrival counter is the arbiter. Group rank 0 decides a timeout by poisoning the
    counter (adding `world_size + 1`), so a rank can never count itself in after the
    decision; it then writes which ranks are missing under `abort` and waits briefly for the
    ranks that did arrive to read it. Every survivor, and a rank that arrives late, reports
    the same missing ranks. Others give up on their own only a grace period later (rank 0
    itself is then the one missing).

    Raises:
        MoeEpTimeoutError: names the ranks that did not arrive, world size and timeout.
        MoeEpPeerError: the store (hosted by a peer) went away; names that peer.
    """
    start = time.monotonic()
    grace = min(2.0, 0.25 * timeout_s + 0.1)
    poison = world_size + 1
    decider = rank == 0
    count, abort = f"{prefix}/count", f"{prefix}/abort"

    def fail(detail: str) -> MoeEpTimeoutError:
        return MoeEpTimeoutError(
            f"{what}: {detail}; world size {world_size}, timeout {timeout_s:g} s, "
            f"seen from rank {rank}"
        )

    try:
        ticket = store.add(count, 1)
        if ticket > world_size:  # rank 0 gave up on this barrier before we arrived
            try:
                store.wait([abort], datetime.timedelta(seconds=grace))
                detail = store.get(abort).decode()
            except Exception:
                detail = "rank 0 abandoned this barrier before this rank arrived"
            raise fail(f"{detail}; this rank arrived after the timeout")
        store.set(f"{prefix}/arrived/{rank}", b"1")
        if ticket == world_size:
            store.set(f"{prefix}/done", b"1")
        pause = 0.0005
        poisoned = False
        while not store.check([f"{prefix}/done"]):
            if store.check([abort]):
                detail = store.get(abort).decode()
                store.add(f"{prefix}/abort_ack", 1)
                raise fail(detail)
            waited = time.monotonic() - start
            if decider and not poisoned and waited > timeout_s:
                poisoned = True
                arrived = store.add(count, poison) - poison
                if arrived < world_size:
                    # ranks that counted themselves in set their key right after
                    until = time.monotonic() + grace
                    missing = _missing(store, prefix, world_size)
                    while world_size - len(missing) < arrived and time.monotonic() < until:
                        time.sleep(0.005)
                        missing = _missing(store, prefix, world_size)
                    detail = (
                        f"rank(s) {missing} did not arrive ({world_size - len(missing)}/"
                        f"{world_size} did)"
                    )
                    store.set(abort, detail.encode())
                    until = time.monotonic() + grace
                    while store.add(f"{prefix}/abort_ack", 0) < arrived - 1:
                        if time.monotonic() >= until:
                            break
                        time.sleep(0.01)
                    raise fail(detail)
                # everyone had arrived: the last one is setting `done`
            if waited > timeout_s + grace:
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
    if rank != STORE_HOST:
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


def rendezvous_url(config: BootstrapConfig) -> tuple[str, int] | None:
    """(host, port) of the store: `config.init_method` wins, else MASTER_ADDR/MASTER_PORT
    (whose RANK / WORLD_SIZE, when set, must agree with the config); else None at world size
    1 (one process has no one to meet: `create_store` makes a local store); else a usage
    error."""
    if config.init_method is not None:
        parsed = urlparse(config.init_method)
        if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
            raise MoeEpUsageError(
                "BootstrapConfig.init_method must be 'tcp://HOST:PORT' (moe-ep hosts the "
                f"store itself), got {config.init_method!r}"
            )
        return parsed.hostname, parsed.port
    addr_port = _env.master_addr_port()
    if addr_port is None and config.world_size > 1:
        raise MoeEpUsageError(
            "torch.distributed is not initialised and moe-ep cannot initialise it: "
            f"BootstrapConfig.world_size={config.world_size} needs a rendezvous: "
            "set MASTER_ADDR and MASTER_PORT (torchrun does), pass "
            "BootstrapConfig(init_method='tcp://HOST:PORT'), or initialise "
            "torch.distributed in the host and pass process_group= (world size 1 needs none)"
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


def port_open(host: str, port: int, deadline: float) -> bool:
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


LIFETIME_KEY = "moe_ep/lifetime"  # which runtime lifetime the store's keys belong to


def create_store(config: BootstrapConfig, timeout_s: float, lifetime: int) -> tuple[Any, str]:
    """Host (rank 0) or join the rendezvous TCPStore, within `timeout_s`; at world size 1
    with no rendezvous configured, an in-process `HashStore` (no port, no network).

    Returns the store with every key under `moe_ep/life-<lifetime>/`, and a description of
    who hosts it. Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True at MASTER_ADDR:PORT)
    the elastic agent already serves a store there, so every rank is a client of it, as
    torch's own env:// rendezvous does.

    Rank 0 writes `LIFETIME_KEY` = `lifetime` into the store; other ranks accept a store only
    once it shows their lifetime. So a rank that bootstraps again right after a teardown,
    and reaches the previous store on the same port before rank 0 has closed it, waits
    (reconnecting when that store goes away) instead of joining a stale store.
    """
    url = rendezvous_url(config)
    if url is None:  # world size 1, nothing configured: nobody to meet
        return dist.PrefixStore(f"moe_ep/life-{lifetime}", dist.HashStore()), LOCAL_STORE_DESC
    host, port = url
    agent = _env.torchelastic_agent_store() and _env.master_addr_port() == (host, port)
    is_rank0 = config.rank == STORE_HOST
    serve = is_rank0 and not agent
    desc = f"the torchelastic agent at {host}:{port}" if agent else f"rank 0 at {host}:{port}"
    deadline = time.monotonic() + timeout_s
    want = str(lifetime).encode()
    store: Any = None
    last_error: BaseException | None = None
    while True:
        try:
            if store is None:
                if not serve and not port_open(host, port, deadline):
                    break
                timeout = datetime.timedelta(seconds=max(0.5, deadline - time.monotonic()))
                store = dist.TCPStore(
                    host, port, config.world_size, serve, timeout, wait_for_workers=False
                )
                if is_rank0:
                    store.set(LIFETIME_KEY, want)
            if is_rank0 or (store.check([LIFETIME_KEY]) and store.get(LIFETIME_KEY) == want):
                return dist.PrefixStore(f"moe_ep/life-{lifetime}", store), desc
        except Exception as exc:
            if serve:
                raise MoeEpPeerError(
                    f"bootstrap: rank 0 could not host the rendezvous store on {host}:{port}: {exc}"
                ) from exc
            last_error, store = exc, None
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    raise MoeEpTimeoutError(
        f"bootstrap: rank(s) [0] did not arrive: rank {config.rank} could not reach the "
        f"rendezvous store hosted by {desc} (or it never showed lifetime {lifetime}) within "
        f"{timeout_s:g} s (world size {config.world_size})"
        + (f": {last_error}" if last_error else "")
    ) from last_error


_host_lifetimes: dict[str, int] = {}  # group tag -> runtimes bootstrapped on it so far


def host_store(group: Any) -> tuple[Any, str]:
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

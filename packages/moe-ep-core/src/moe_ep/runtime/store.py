"""The rendezvous store moe-ep hosts, and barriers over a store that are bounded in time.

One process (world size 1) with no rendezvous configured gets a local in-process store.
The store rank 0 hosts listens only on the address the ranks use (a socket moe-ep binds
itself, handed to torch's TCPStore as `master_listen_fd`), so `MASTER_ADDR=127.0.0.1`
stays on loopback. With `BootstrapConfig.external_store` (or torchrun's agent store) no EP
rank hosts it: every rank is a client (`moe_ep.runtime.store_server` serves one).

Barriers run over the store rather than the process group: a dead peer then shows up as a
missing key, which names the rank, instead of a hung or aborted collective.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist

from moe_ep import env as _env
from moe_ep.config import BootstrapConfig
from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError, MoeEpUsageError
from moe_ep.runtime.bounded import BoundedStore, StoreLost, call_with_deadline, grace_s
from moe_ep.runtime.faults import FaultBoard, Verdict
from moe_ep.runtime.keys import Keys

__all__ = [
    "LIFETIME_KEY",
    "LOCAL_STORE_DESC",
    "STORE_HOST",
    "create_store",
    "host_store",
    "port_open",
    "rendezvous_url",
    "serve_tcp_store",
    "store_barrier",
    "world_size_claims",
]

STORE_HOST = 0  # group rank hosting the TCPStore moe-ep creates
LOCAL_STORE_DESC = "this process's local store (world size 1, no rendezvous)"


# ---------------------------------------------------------------- bounded store barrier


def store_barrier(
    store: BoundedStore,
    name: str,
    *,
    keys: Keys,
    board: FaultBoard,
    rank: int,
    world_size: int,
    timeout_s: float,
    what: str,
    host_waits_for_exit: bool = False,
    on_poll: Callable[[float], None] | None = None,
) -> None:
    """All `world_size` ranks meet at barrier `name`, or every survivor raises the same
    error within `timeout_s + 2 * grace_s(timeout_s)`.

    A rank is through once every rank's arrival key exists (with sealed `keys` no other
    process can create one). The arrival counter arbitrates a timeout: group rank 0
    decides it by poisoning the counter (adding `world_size + 1`, so no rank can count
    itself in afterwards) and proposes the missing ranks as the verdict on `board`; the
    ranks that did arrive, and a rank that arrives late, raise that verdict. A failure
    reported on `board` (a peer's bad input, a broken collective) ends the wait at once,
    unless every rank has arrived by then (the barrier held for the reporter: it holds here
    too, and the failure is seen at the next wait).
    `on_poll(deadline)` runs at each poll (the bootstrap checks world-size claims there).

    Raises:
        MoeEpTimeoutError: names the ranks that did not arrive, world size and timeout.
        MoeEpPeerError: a failure reported on the board, or the store (hosted by a peer)
            went away; names the rank(s).
    """
    start = time.monotonic()
    grace = grace_s(timeout_s)
    end = start + timeout_s + 2 * grace  # no store call may outlive the barrier's bound
    poison = world_size + 1
    count = keys.key(f"{name}/count")
    arrived = [keys.key(f"{name}/arrived/{r}") for r in range(world_size)]

    def fail(verdict: Verdict, late: bool = False) -> MoeEpPeerError:
        return verdict.error(
            what + ("; this rank arrived after the timeout" if late else ""),
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
        )

    try:
        ticket = store.add(count, 1, end)
        if ticket > world_size:  # rank 0 closed this barrier before we arrived
            raise fail(board.await_verdict(), late=True)
        store.set(arrived[rank], keys.pack(arrived[rank], b"1"), end)
        pause = 0.0005
        poisoned = False
        while not store.check(arrived, end):
            if on_poll is not None:
                on_poll(end)
            if board.is_open(end):
                # every rank may have arrived since the check above, and one of them gone on
                # and failed after the barrier: the barrier held for it, so it holds here too
                # (its failure is seen at the next wait)
                if store.check(arrived, end):
                    break
                raise fail(board.agree("board"))
            waited = time.monotonic() - start
            if rank == 0 and not poisoned and waited > timeout_s:
                poisoned = True
                counted = store.add(count, poison, end) - poison
                if counted < world_size:
                    # ranks that counted themselves in set their key right after
                    until = time.monotonic() + grace
                    missing = [r for r, k in enumerate(arrived) if not store.check([k], end)]
                    while world_size - len(missing) < counted and time.monotonic() < until:
                        time.sleep(0.005)
                        missing = [r for r in missing if not store.check([arrived[r]], end)]
                    reasons = {r: f"did not arrive within {timeout_s:g} s" for r in missing}
                    raise fail(board.decide(Verdict(tuple(missing), reasons, timed_out=True)))
                # every rank had counted itself in: the last keys are being set
            if waited > timeout_s + grace:  # rank 0 did not decide: it is the one missing
                raise fail(board.agree("timeout"))
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        if on_poll is not None:
            on_poll(end)
    except StoreLost as lost:
        raise fail(board.lost_verdict(lost)) from lost
    if not host_waits_for_exit:
        return
    if rank != store.host_rank:  # None (served outside the EP ranks): nobody waits
        # The host may be gone already; nothing is left to coordinate then.
        with contextlib.suppress(StoreLost):
            if store.add(keys.key(f"{name}/left"), 1, end) == world_size - 1:
                store.set(keys.key(f"{name}/all_left"), b"1", end)
    elif world_size > 1:
        # Everyone arrived; a rank that vanished since cannot be waited for.
        all_left = keys.key(f"{name}/all_left")
        with contextlib.suppress(StoreLost):
            while not store.check([all_left], end) and time.monotonic() < start + timeout_s:
                time.sleep(0.005)


def world_size_claims(
    store: BoundedStore, keys: Keys, config: BootstrapConfig, deadline: float
) -> Callable[[float], None]:
    """Write this rank's world size under `claim/<rank>`; returns the bootstrap barrier's
    `on_poll` check, which compares it with rank 0's (rank 0: with every rank's).

    Raises (from the check): MoeEpUsageError naming who claimed which world size.
    """
    mine, rank = config.world_size, config.rank
    store.set(keys.key(f"claim/{rank}"), str(mine).encode(), deadline)
    unchecked = set(range(1, mine)) if rank == 0 else {0}

    def check(deadline: float) -> None:
        for other in sorted(unchecked):
            key = keys.key(f"claim/{other}")
            if not store.check([key], deadline):
                continue
            unchecked.discard(other)
            theirs = store.get(key, deadline).decode(errors="replace")
            if theirs != str(mine):
                raise MoeEpUsageError(
                    f"the ranks disagree on the world size: rank {other} claims "
                    f"world_size={theirs}, rank {rank} claims world_size={mine} "
                    "(BootstrapConfig.world_size, and WORLD_SIZE under torchrun, must be "
                    "equal on every rank)"
                )

    return check


# ---------------------------------------------------------------- rendezvous


def rendezvous_url(config: BootstrapConfig) -> tuple[str, int] | None:
    """(host, port) of the store: `config.init_method` wins, else MASTER_ADDR/MASTER_PORT
    (whose RANK / WORLD_SIZE, when set, must agree with the config); else None at world size
    1 (one process has no one to meet: `create_store` makes a local store); else a usage
    error (always one with `config.external_store`: it names a store to reach)."""
    if config.init_method is not None:
        parsed = urlparse(config.init_method)
        if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
            raise MoeEpUsageError(
                "BootstrapConfig.init_method must be 'tcp://HOST:PORT' (moe-ep hosts the "
                f"store itself), got {config.init_method!r}"
            )
        return parsed.hostname, parsed.port
    addr_port = _env.master_addr_port()
    if addr_port is None and config.external_store:
        raise MoeEpUsageError(
            "BootstrapConfig.external_store=True needs the external store's address: pass "
            "init_method='tcp://HOST:PORT' (e.g. moe_ep.runtime.store_server.serve_store()"
            ".init_method) or set MASTER_ADDR and MASTER_PORT; neither is set (world size "
            f"{config.world_size})"
        )
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
    """Poll until something listens on host:port (`host` resolved already: a name would
    be looked up again on every try)."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _resolve(host: str, port: int, source: str, deadline: float) -> tuple[int, str]:
    """(address family, numeric address) of `host`, looked up once within the deadline."""
    try:
        infos = call_with_deadline(
            lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM),
            max(0.0, deadline - time.monotonic()),
            f"resolving {host!r}",
        )
    except TimeoutError as exc:
        raise MoeEpTimeoutError(
            f"bootstrap: the rendezvous host {source}={host!r} did not resolve in time: {exc}"
        ) from exc
    except OSError as exc:
        raise MoeEpUsageError(
            f"bootstrap: the rendezvous host {source}={host!r} does not resolve ({exc}); "
            "it must be a host name or address every rank can reach"
        ) from exc
    family, _, _, _, sockaddr = infos[0]
    return int(family), str(sockaddr[0])


def _listen(family: int, address: str, port: int) -> tuple[int, int]:
    """A listening socket on exactly (address, port) (port 0: one the kernel picks);
    returns its fd (torch's TCPStore takes ownership) and the port it is bound to."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
        bound = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    return sock.detach(), bound


def serve_tcp_store(family: int, address: str, port: int, timeout_s: float) -> tuple[Any, int]:
    """A TCPStore server listening only on (address, port) (0: a free port), with no fixed
    world size; returns it and its port. The server runs until the object is dropped."""
    fd, bound = _listen(family, address, port)
    store = dist.TCPStore(
        address, bound, None, True, datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=fd,
    )  # fmt: skip
    return store, bound


LIFETIME_KEY = "moe_ep/lifetime"  # which runtime lifetime the store's keys belong to


def create_store(config: BootstrapConfig, timeout_s: float, lifetime: int) -> BoundedStore:
    """Host (rank 0) or join the rendezvous TCPStore, within `timeout_s`; at world size 1
    with no rendezvous configured, an in-process `HashStore` (no port, no network).

    Returns the store with every key under `moe_ep/life-<lifetime>/`. Rank 0 listens only
    on the rendezvous address. Under torchrun (TORCHELASTIC_USE_AGENT_STORE=True at
    MASTER_ADDR:PORT) the elastic agent already serves a store there, and with
    `config.external_store` another process does (`moe_ep.runtime.store_server`): then
    every rank is a client of it, as torch's own env:// rendezvous does, and the store's
    `host_rank` is None (no EP rank's loss takes it down).

    Rank 0 writes `LIFETIME_KEY` = `lifetime` into the store; other ranks accept a store only
    once it shows their lifetime. So a rank that bootstraps again right after a teardown,
    and reaches the previous store on the same port before rank 0 has closed it, waits
    (reconnecting when that store goes away) instead of joining a stale store.

    Raises:
        MoeEpUsageError: the rendezvous host does not resolve; external_store without an
            address.
        MoeEpTimeoutError: the store did not answer (or show this lifetime) in time.
        MoeEpPeerError: rank 0 could not host the store, or nothing served it.
    """
    url = rendezvous_url(config)
    prefix = f"moe_ep/life-{lifetime}"
    if url is None:  # world size 1, nothing configured: nobody to meet
        local = dist.PrefixStore(prefix, dist.HashStore())
        return BoundedStore(local, host_desc=LOCAL_STORE_DESC, host_rank=config.rank)
    host, port = url
    source = "BootstrapConfig.init_method" if config.init_method is not None else "MASTER_ADDR"
    agent = _env.torchelastic_agent_store() and _env.master_addr_port() == (host, port)
    is_rank0 = config.rank == STORE_HOST
    serve = is_rank0 and not agent and not config.external_store
    if agent:
        desc = f"the torchelastic agent at {host}:{port}"
    elif config.external_store:
        desc = f"the external store server at {host}:{port}"
    else:
        desc = f"rank 0 at {host}:{port}"
    host_rank = None if agent or config.external_store else STORE_HOST
    deadline = time.monotonic() + timeout_s
    family, address = _resolve(host, port, source, deadline)
    store_timeout = datetime.timedelta(seconds=timeout_s)
    want = str(lifetime).encode()

    def connect() -> Any:
        if serve:
            fd, _ = _listen(family, address, port)
            store: Any = dist.TCPStore(
                address, port, config.world_size, True, store_timeout,
                wait_for_workers=False, master_listen_fd=fd,
            )  # fmt: skip
            store.set(LIFETIME_KEY, want)
            return store
        store = dist.TCPStore(
            address, port, config.world_size, False, store_timeout, wait_for_workers=False
        )  # fmt: skip
        if is_rank0:  # the agent or an external server serves: rank 0 only marks it
            store.set(LIFETIME_KEY, want)
            return store
        # a store of an earlier lifetime (or of another job) is not ours: try again
        ok = store.check([LIFETIME_KEY]) and store.get(LIFETIME_KEY) == want
        return store if ok else None

    last_error: BaseException | None = None
    frozen = False
    while True:
        try:
            if serve or port_open(address, port, deadline):
                store = call_with_deadline(
                    connect, max(0.0, deadline - time.monotonic()), "joining the store"
                )
                if store is not None:
                    prefixed = dist.PrefixStore(prefix, store)
                    return BoundedStore(prefixed, host_desc=desc, host_rank=host_rank)
        except TimeoutError as exc:
            # torch's connect also retries a refused connection until its own timeout:
            # whether anything still accepts tells a frozen host from a gone one
            last_error = exc
            frozen = port_open(address, port, time.monotonic())
            break
        except Exception as exc:
            if serve:
                raise MoeEpPeerError(
                    f"bootstrap: rank 0 could not host the rendezvous store on "
                    f"{address}:{port}: {exc}"
                ) from exc
            last_error = exc
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    # A host that accepts but never answers is frozen (`MoeEpTimeoutError`, as when a
    # store already reached stops answering); one that refuses, or never listened, is gone
    # or never came (`MoeEpPeerError`, as when a reached store goes away).
    cls = MoeEpTimeoutError if frozen else MoeEpPeerError
    who = "" if host_rank is None else f"rank(s) [{host_rank}] failed: "
    hint = (
        "; is the store server running there (moe_ep.runtime.store_server)?"
        if config.external_store and not agent
        else ""
    )
    raise cls(
        f"moe-ep bootstrap: {who}rank {config.rank} could not reach the "
        f"rendezvous store hosted by {desc} (or it never showed lifetime {lifetime}) within "
        f"{timeout_s:g} s (world size {config.world_size})"
        + (f": {last_error}" if last_error else "")
        + hint,
        failed_ranks=() if host_rank is None else (host_rank,),
    ) from last_error


_host_lifetimes: dict[str, int] = {}  # group tag -> runtimes bootstrapped on it so far


def host_store(group: Any) -> BoundedStore | None:
    """The host's default store, namespaced for this group and this runtime lifetime (the
    host's store outlives us, so barrier keys of an earlier lifetime must not be reused);
    None if torch hides it. Its host is the default group's rank 0 (global rank 0)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    ranks = dist.get_process_group_ranks(group)
    tag = hashlib.sha1(repr(ranks).encode()).hexdigest()[:12]
    life = _host_lifetimes[tag] = _host_lifetimes.get(tag, 0) + 1
    prefix = f"moe_ep/group-{tag}/life-{life}"
    agent = _env.torchelastic_agent_store()
    host_rank = None if agent or 0 not in ranks else ranks.index(0)
    desc = "the torchelastic agent" if agent else "the host's default store (global rank 0)"
    return BoundedStore(dist.PrefixStore(prefix, store), host_desc=desc, host_rank=host_rank)

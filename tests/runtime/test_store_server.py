"""`moe_ep.runtime.store_server` and `BootstrapConfig.external_store`: a store no EP rank
hosts, in this process or a child; every rank a client of it; contradictions refused."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch.distributed as dist

from moe_ep import BootstrapConfig, runtime
from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError, MoeEpUsageError
from moe_ep.runtime.bounded import call_with_deadline
from moe_ep.runtime.store import LIFETIME_KEY, port_open
from moe_ep.runtime.store_server import READY_LINE, serve_store
from moe_ep.spawn import free_port, spawn_local


def _client(host: str, port: int) -> Any:
    return dist.TCPStore(
        host, port, None, False, datetime.timedelta(seconds=5), wait_for_workers=False
    )


@pytest.mark.parametrize("child", [False, True])
def test_a_server_serves_clients_and_closes_cleanly(child: bool) -> None:
    server = serve_store("127.0.0.1", child=child, timeout_s=30)
    assert server.init_method == f"tcp://127.0.0.1:{server.port}" and server.serving
    assert (server.pid == os.getpid()) is not child
    a, b = _client(server.host, server.port), _client(server.host, server.port)
    a.set("k", b"v")
    assert b.get("k") == b"v" and b.add("n", 2) == 2 and a.add("n", 1) == 3
    server.close()
    assert not server.serving
    assert not port_open(server.host, server.port, time.monotonic() + 1.0)
    with pytest.raises(Exception) as info:  # torch's own error type for a gone store
        call_with_deadline(lambda: a.get("k"), 10, "a get after the close")
    assert not isinstance(info.value, TimeoutError)  # it fails, it does not hang
    server.close()  # idempotent


def test_a_port_in_use_is_a_usage_error_naming_it() -> None:
    with serve_store() as first:
        with pytest.raises(MoeEpUsageError, match=rf"cannot listen on 127\.0\.0\.1:{first.port}"):
            serve_store(port=first.port)
        with pytest.raises(MoeEpUsageError, match="the server process exited with code 2"):
            serve_store(port=first.port, child=True)


def test_the_standalone_server_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_ep.runtime.store_server", "--port", "0"],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        word, host, port = proc.stdout.readline().decode().split()
        assert word == READY_LINE
        _client(host, int(port)).set("k", b"v")  # serving, stdin at EOF notwithstanding
        proc.terminate()
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"host": ""}, "host must be a non-empty"),
     ({"port": 70000}, "port must be an int in 0..65535 .* got 70000"),
     ({"port": True}, "port must be an int .* got True"),
     ({"child": 1}, "child must be a bool, got 1"),
     ({"timeout_s": 0}, "timeout_s must be a number of seconds > 0 .* got 0"),
     ({"host": "no-such-host.invalid"}, "host 'no-such-host.invalid' does not resolve")],
)  # fmt: skip
def test_bad_server_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(MoeEpUsageError, match=match):
        serve_store(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"external_store": 1}, r"external_store must be a bool, got 1 \(int\)"),
     ({"external_store": True, "auto_bootstrap": False}, "contradicts auto_bootstrap=False"),
     ({"external_store": True, "process_group": object()}, "contradicts process_group=")],
)  # fmt: skip
def test_contradicting_configs_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(MoeEpUsageError, match=match):
        BootstrapConfig(2, 0, **kwargs)


def test_external_store_needs_an_address_even_at_world_size_1() -> None:
    # without the flag, world size 1 gets a local store and needs none
    with pytest.raises(MoeEpUsageError, match="external_store=True needs the external store's"):
        runtime.acquire(BootstrapConfig(1, 0, external_store=True, timeout_s=2))


def test_without_the_flag_rank_0_tries_to_host_where_a_server_already_listens() -> None:
    # the planted fault for the flag: rank 0 is then a server, not a client, and cannot bind
    with serve_store() as server, pytest.raises(MoeEpPeerError, match="could not host"):
        runtime.acquire(BootstrapConfig(1, 0, init_method=server.init_method, timeout_s=2))


def test_nothing_serving_at_the_address_names_the_store_server() -> None:
    addr = f"tcp://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises((MoeEpPeerError, MoeEpTimeoutError)) as info:
        runtime.acquire(BootstrapConfig(1, 0, init_method=addr, external_store=True, timeout_s=1))
    assert time.monotonic() - start < 1 + 2 * 0.5 + 1.0
    assert "external store server" in str(info.value) and "store_server" in str(info.value)
    assert info.value.failed_ranks == ()  # no EP rank is to blame


def _client_worker(rank: int, world_size: int, addr: str) -> dict[str, Any]:
    from moe_ep.runtime.state import PROCESS

    with runtime.acquire(
        BootstrapConfig(world_size, rank, init_method=addr, external_store=True, timeout_s=4)
    ) as rt:
        state = PROCESS.state
        assert state is not None and state.store is not None
        host, desc = state.store.host_rank, state.store.host_desc
        rt.barrier()
        return {"host_rank": host, "desc": desc, "life": PROCESS.lifetimes}


def test_every_rank_is_a_client_and_rank_0_marks_the_lifetime() -> None:
    with serve_store() as server:
        results = spawn_local(_client_worker, 2, server.init_method, timeout_s=120)
        for res in results:
            assert res["host_rank"] is None
            assert res["desc"] == f"the external store server at 127.0.0.1:{server.port}"
        # the keys live in the server, which outlived both ranks' teardown
        assert _client(server.host, server.port).get(LIFETIME_KEY) == b"1"
        assert results[0]["life"] == 1

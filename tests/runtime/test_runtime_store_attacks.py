"""Nothing planted in the rendezvous store runs: forged barrier keys, and where it listens.

A separate process (`store_attacker.py`) that can reach the store, list its keys and write
any key forges the barrier protocol's `done` and `abort` keys (the attacks of issue #13:
a forged `done` let rank 0 leave a barrier before rank 1 arrived; a forged `abort` made
rank 0 blame rank 1 while rank 1 passed). With the run token sealing the keys, both fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from moe_ep import BootstrapConfig
from moe_ep.errors import MoeEpPeerError
from moe_ep.spawn import spawn_local

pytestmark = pytest.mark.multirank

ATTACKER = Path(__file__).with_name("store_attacker.py")
LATE_S = 3.0  # rank 1 reaches the attacked barrier this much after rank 0


def _forgery_worker(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    from moe_ep import runtime

    out: dict[str, Any] = {}
    attacker = None
    if rank == 1:  # started first: importing torch takes a few seconds
        attacker = subprocess.Popen(
            [sys.executable, str(ATTACKER), "127.0.0.1", os.environ["MASTER_PORT"], mode, "12"],
            stdout=subprocess.PIPE,
            text=True,
        )
    with runtime.acquire(BootstrapConfig(world_size, rank, timeout_s=30)) as rt:
        if attacker is not None:
            assert attacker.stdout is not None
            assert attacker.stdout.readline().strip() == "ready"
        rt.barrier()  # both ranks here, the attacker forging
        if rank == 1:
            time.sleep(LATE_S)
        start = time.monotonic()
        try:
            rt.barrier()
            out["outcome"] = "passed"
        except MoeEpPeerError as exc:
            out["outcome"] = f"{type(exc).__name__}: {exc}"
        out["elapsed"] = time.monotonic() - start
        if attacker is not None:
            out["written"] = int(attacker.communicate(timeout=60)[0].split()[-1])
        if out["outcome"] == "passed":
            rt.barrier()
    return out


@pytest.mark.parametrize("mode", ["done", "abort"])
def test_forged_barrier_keys_are_ignored(mode: str) -> None:
    first, late = spawn_local(_forgery_worker, 2, mode, timeout_s=120)
    assert late["written"] > 0  # the attacker did reach the store and write its keys
    assert first["outcome"] == "passed", first  # no forged abort blames rank 1
    assert late["outcome"] == "passed", late
    # rank 0 waited for rank 1: a forged `done` did not let it through early
    assert first["elapsed"] > LATE_S - 0.5, first


def _listen_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port` (/proc/net/tcp, tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(addr)
                    words = [raw[i : i + 4][::-1] for i in range(0, len(raw), 4)]
                    found.add(
                        ":".join(w.hex() for w in words)
                        if len(raw) == 16
                        else ".".join(str(b) for b in words[0])
                    )
    return found


def _listen_worker(rank: int, world_size: int) -> set[str]:
    from moe_ep import runtime

    with runtime.acquire(BootstrapConfig(world_size, rank, timeout_s=30)) as rt:
        addresses = _listen_addresses(int(os.environ["MASTER_PORT"])) if rank == 0 else set()
        rt.barrier()
    return addresses


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads Linux /proc/net/tcp")
def test_store_listens_only_on_the_rendezvous_address() -> None:
    addresses, _ = spawn_local(_listen_worker, 2, timeout_s=120)
    assert addresses == {"127.0.0.1"}  # MASTER_ADDR=127.0.0.1: not every interface


def test_sealed_keys_hide_names_and_refuse_altered_values() -> None:
    from moe_ep.runtime.keys import Keys

    token = bytes(range(32))
    sealed, other = Keys("rt", token), Keys("rt", bytes(32))
    key = sealed.key("barrier/1/arrived/0")
    assert "barrier" not in key and key.startswith("rt/")
    assert key != other.key("barrier/1/arrived/0")  # the name depends on the token
    assert key != sealed.key("barrier/1/arrived/1") != sealed.key("barrier/2/arrived/0")
    value = sealed.pack(key, b"payload")
    assert sealed.unpack(key, value) == b"payload"
    assert sealed.unpack(key, value[:-1] + b"X") is None  # altered payload
    assert sealed.unpack(sealed.key("fault/verdict"), value) is None  # moved to another key
    assert other.unpack(key, other.pack(key, b"payload")) == b"payload"
    assert sealed.unpack(key, other.pack(key, b"payload")) is None  # sealed without the token
    plain = Keys("boot")
    assert plain.key("bootstrap/count") == "boot/bootstrap/count"
    assert plain.unpack("k", b"v") == b"v"

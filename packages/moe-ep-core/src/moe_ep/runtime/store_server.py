"""A rendezvous store served outside the EP ranks, for `BootstrapConfig(external_store=True)`.

By default EP rank 0 hosts the store, so losing rank 0 takes the store with it and the
survivors cannot rebuild (`MoEEpLayer.evict` refuses). A store served by the launcher (a
Ray driver, `moe-ep smoke`'s parent, a job controller) or by a process of its own outlives
any one EP rank, so any rank can be evicted (docs/placement.md, "Eviction"):

    server = serve_store("10.0.0.1")  # this process serves it, on a free port
    cfg = BootstrapConfig(W, r, init_method=server.init_method, external_store=True)
    ...
    server.close()

`serve_store(..., child=True)` serves it from a child process instead, which also exits
when this process goes; `python -m moe_ep.runtime.store_server --host H --port P` serves
one until SIGTERM / SIGINT (a store on a machine of its own).

A server serves one EP job: its keys outlive the job's processes, and a new job's ranks
count their bootstraps from 1 again, so give each job a server of its own.
"""

from __future__ import annotations

import argparse
import contextlib
import numbers
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import TracebackType
from typing import IO, Any

from moe_ep import env as _env
from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError, MoeEpUsageError
from moe_ep.runtime.bounded import call_with_deadline
from moe_ep.runtime.store import serve_tcp_store

__all__ = ["READY_LINE", "StoreServer", "main", "serve_store"]

READY_LINE = "MOE_EP_STORE_SERVER"
"""The first word of the line a server process prints once it serves: `READY_LINE ADDR PORT`."""


class StoreServer:
    """A TCPStore server no EP rank hosts (from `serve_store`); a context manager.

    `host` is the numeric address it listens on (only that one), `port` its port,
    `init_method` the `tcp://` URL to give every rank with `external_store=True`, `pid` the
    process serving it (this one, or the child).
    """

    def __init__(
        self, host: str, port: int, *, store: Any = None, process: Any = None, stderr: Any = None
    ) -> None:
        self.host = host
        self.port = port
        self._store = store
        self._process: subprocess.Popen[bytes] | None = process
        self._stderr: IO[bytes] | None = stderr
        self.pid = os.getpid() if process is None else int(process.pid)

    @property
    def init_method(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def serving(self) -> bool:
        if self._process is not None:
            return self._process.poll() is None
        return self._store is not None

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving (idempotent): the clients' next store call fails, which the ranks
        report as a lost store. A child still alive `timeout_s` after its stdin closed is
        killed."""
        self._store = None  # torch stops the server when its object goes
        proc, self._process = self._process, None
        if proc is not None:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdout, self._stderr):
                if pipe is not None:
                    pipe.close()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "this process" if self.pid == os.getpid() else f"child pid {self.pid}"
        state = "serving" if self.serving else "closed"
        return f"StoreServer({self.init_method}, {where}, {state})"


def _check_args(host: object, port: object, child: object, timeout_s: object) -> float:
    if not isinstance(host, str) or not host:
        raise MoeEpUsageError(
            f"serve_store: host must be a non-empty host name or address, got {host!r}"
        )
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise MoeEpUsageError(
            f"serve_store: port must be an int in 0..65535 (0: a free port), got {port!r}"
        )
    if not isinstance(child, bool):
        raise MoeEpUsageError(f"serve_store: child must be a bool, got {child!r}")
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, numbers.Real)
        or not 0 < float(timeout_s) <= _env.MAX_TIMEOUT_S
    ):
        raise MoeEpUsageError(
            f"serve_store: timeout_s must be a number of seconds > 0 and <= "
            f"{_env.MAX_TIMEOUT_S:g}, got {timeout_s!r}"
        )
    return float(timeout_s)


def serve_store(
    host: str = "127.0.0.1", port: int = 0, *, child: bool = False, timeout_s: float = 30.0
) -> StoreServer:
    """Serve a rendezvous TCPStore on `host` (an address every EP rank reaches; the server
    listens on that address only) and `port` (0: a free one), in this process or, with
    `child=True`, in a child process; returns once it accepts connections, within
    `timeout_s` (which also bounds each store request the server waits on).

    Raises:
        MoeEpUsageError: a bad argument, a host that does not resolve, or an address or
            port this machine cannot listen on (e.g. in use).
        MoeEpTimeoutError: the server did not start within `timeout_s`.
        MoeEpPeerError: the child process died before serving.
    """
    timeout = _check_args(host, port, child, timeout_s)
    if child:
        return _serve_in_child(host, port, timeout)
    deadline = time.monotonic() + timeout
    try:
        infos = call_with_deadline(
            lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM),
            timeout,
            f"resolving {host!r}",
        )
    except TimeoutError as exc:
        raise MoeEpTimeoutError(
            f"serve_store: host {host!r} did not resolve in time: {exc}"
        ) from exc
    except OSError as exc:
        raise MoeEpUsageError(f"serve_store: host {host!r} does not resolve ({exc})") from exc
    family, _, _, _, sockaddr = infos[0]
    address = str(sockaddr[0])
    try:
        store, bound = call_with_deadline(
            lambda: serve_tcp_store(int(family), address, port, timeout),
            max(0.0, deadline - time.monotonic()),
            "starting the store server",
        )
    except TimeoutError as exc:
        raise MoeEpTimeoutError(f"serve_store: the server on {address}:{port} {exc}") from exc
    except OSError as exc:
        raise MoeEpUsageError(
            f"serve_store: cannot listen on {address}:{port} ({exc}); host must be an address "
            "of this machine and port a free one (0 picks one)"
        ) from exc
    except Exception as exc:  # torch's own errors (DistNetworkError, ...)
        raise MoeEpPeerError(
            f"serve_store: torch's TCPStore server did not start on {address}:{port}: {exc}"
        ) from exc
    return StoreServer(address, bound, store=store)


def _serve_in_child(host: str, port: int, timeout_s: float) -> StoreServer:
    cmd = [sys.executable, "-m", "moe_ep.runtime.store_server", "--host", host,
           "--port", str(port), "--timeout-s", repr(timeout_s), "--exit-on-stdin-eof"]  # fmt: skip
    # a file, not a pipe: a pipe nobody reads could fill and block the server; closed by
    # StoreServer.close()
    err = tempfile.TemporaryFile()  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
    assert proc.stdout is not None
    readline = proc.stdout.readline
    try:
        line = call_with_deadline(readline, timeout_s, "waiting for the store server")
    except TimeoutError as exc:
        proc.kill()
        proc.wait()
        err.close()
        raise MoeEpTimeoutError(
            f"serve_store(child=True): the server process did not serve within {timeout_s:g} s"
        ) from exc
    words = line.decode(errors="replace").split()
    if len(words) == 3 and words[0] == READY_LINE and words[2].isdigit():
        return StoreServer(words[1], int(words[2]), process=proc, stderr=err)
    code = proc.wait()
    err.seek(0)
    why = " ".join(err.read().decode(errors="replace").split()[-60:])
    err.close()
    cls = MoeEpUsageError if code == 2 else MoeEpPeerError
    raise cls(f"serve_store(child=True): the server process exited with code {code}: {why}")


def main(argv: list[str] | None = None) -> int:
    """`python -m moe_ep.runtime.store_server`: serve until SIGTERM / SIGINT (or, with
    --exit-on-stdin-eof, until stdin closes); prints `READY_LINE ADDR PORT` once serving.
    Exit 0 after a clean stop, 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="python -m moe_ep.runtime.store_server",
        description="Serve a moe-ep rendezvous store outside the EP ranks "
        "(BootstrapConfig(external_store=True, init_method='tcp://ADDR:PORT')).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port (0: a free one)")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="startup bound")
    parser.add_argument("--exit-on-stdin-eof", action="store_true",
                        help="also stop when stdin closes (serve_store(child=True))")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        server = serve_store(args.host, args.port, timeout_s=args.timeout_s)
    except MoeEpUsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.exit_on_stdin_eof:

        def watch() -> None:
            with contextlib.suppress(OSError, ValueError):
                while sys.stdin.buffer.read(4096):
                    pass
            stop.set()

        threading.Thread(target=watch, name="moe-ep store server stdin", daemon=True).start()
    print(f"{READY_LINE} {server.host} {server.port}", flush=True)
    while not stop.wait(0.2):
        pass
    server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

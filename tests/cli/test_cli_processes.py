"""A real `moe-ep run` stopped by SIGTERM or SIGKILL leaves no process behind: not its ranks,
not the forkserver, not the resource tracker.

Every process of the run is found through /proc: each inherits the environment the test
gives `moe-ep` (the forkserver and the resource tracker are exec'd with it, the ranks are
forked from the forkserver), so a unique variable in it marks them all, reparented or not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.multirank,
    pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc"),
]

TAG = "MOE_EP_TEST_PROCESS_TAG"
# tiny forwards, enough of them to outlast the test
ENDLESS_RUN = ["run", "--world-size", "2", "--tokens", "8", "--hidden", "64"]
ENDLESS_RUN += ["--intermediate", "32", "--experts", "4", "--topk", "2", "--iters", "10000000"]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid`, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def tagged(tag: str) -> dict[int, int]:
    """pid -> parent pid of every live (not zombie) process whose environment has the tag."""
    marker = f"{TAG}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        stat = _stat(int(entry.name))
        if marker in environ.split(b"\0") and stat is not None and stat[0] != "Z":
            found[int(entry.name)] = stat[1]
    return found


def ranks_of(main_pid: int, procs: dict[int, int]) -> list[int]:
    """The ranks: children of the forkserver, itself a child of `moe-ep`."""
    return [pid for pid, ppid in procs.items() if procs.get(ppid) == main_pid]


def start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    """`moe-ep run` (endless) with a unique tag; returns once both ranks run."""
    tag = uuid.uuid4().hex
    err = tmp_path / "stderr.txt"
    with err.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moe_ep.cli", *ENDLESS_RUN],
            env={**os.environ, TAG: tag},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    deadline = time.monotonic() + 120
    while len(ranks_of(proc.pid, tagged(tag))) < 2:
        assert proc.poll() is None, err.read_text()
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    time.sleep(1.0)  # into construction / the forward loop
    return proc, tag, err


def wait_until_gone(tag: str, seconds: float) -> dict[int, int]:
    deadline = time.monotonic() + seconds
    while (left := tagged(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_leftovers(proc: subprocess.Popen[bytes], tag: str) -> None:
    proc.kill()
    proc.wait()
    for pid in tagged(tag):  # only this test's processes carry the tag
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_sigterm_stops_every_process_and_exits_143(tmp_path: Path) -> None:
    proc, tag, err = start(tmp_path)
    try:
        assert len(tagged(tag)) >= 4  # moe-ep, forkserver, resource tracker, 2 ranks
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        left = wait_until_gone(tag, 15)
        assert not left, f"still running after SIGTERM: {left}"
        text = err.read_text()
        assert "Traceback" not in text, text
        assert text.splitlines()[-1] == "moe-ep: error: terminated by SIGTERM", text
    finally:
        kill_leftovers(proc, tag)


@pytest.mark.slow  # the default run has the same watchdog in test_runtime_launch.py
def test_sigkill_of_moe_ep_takes_its_ranks_down_too(tmp_path: Path) -> None:
    proc, tag, _ = start(tmp_path)
    try:
        proc.kill()  # no handler, no clean-up in moe-ep itself
        proc.wait(timeout=30)
        left = wait_until_gone(tag, 15)
        assert not left, f"still running after moe-ep was killed: {left}"
    finally:
        kill_leftovers(proc, tag)

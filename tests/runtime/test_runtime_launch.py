"""spawn_local: results in rank order, per-rank env, failures with tracebacks (or the signal
that killed a rank), timeouts; ranks stopped with SIGTERM first and never outliving the launcher."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError, MoeEpUsageError
from moe_ep.spawn import launch_local, spawn_local

pytestmark = pytest.mark.multirank


def _report_env(rank: int, world_size: int, scale: int) -> tuple[int, dict[str, str], int]:
    keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MOE_EP_EXTRA")
    return rank * scale, {k: os.environ.get(k, "") for k in keys}, os.getpid()


def test_results_in_rank_order_with_torchrun_env() -> None:
    results = spawn_local(_report_env, 3, 10, env={"MOE_EP_EXTRA": "x"}, timeout_s=60)
    assert [r[0] for r in results] == [0, 10, 20]
    envs = [r[1] for r in results]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
    assert len({e["MASTER_PORT"] for e in envs}) == 1 and int(envs[0]["MASTER_PORT"]) > 0
    assert {e["MOE_EP_EXTRA"] for e in envs} == {"x"}
    pids = {r[2] for r in results}
    assert len(pids) == 3 and os.getpid() not in pids
    assert not multiprocessing.active_children()


def _start_grandchild(rank: int, world_size: int) -> int:
    import multiprocessing as mp

    proc = mp.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join()
    return int(proc.exitcode or 0)


def test_a_rank_may_start_its_own_processes() -> None:
    assert spawn_local(_start_grandchild, 1, timeout_s=60) == [0]


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError(f"boom from rank {rank}")
    return rank


def test_raising_rank_is_named_with_its_traceback() -> None:
    with pytest.raises(MoeEpPeerError) as info:
        spawn_local(_raise_on_rank_one, 2, timeout_s=60)
    msg = str(info.value)
    assert "rank(s) [1]" in msg and "boom from rank 1" in msg
    assert "Traceback" in msg and "_raise_on_rank_one" in msg
    assert "rank 0 raised" not in msg
    assert not isinstance(info.value, MoeEpTimeoutError)
    assert info.value.rank_errors == {1: "KeyError"}


def _die_on_rank_zero(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def test_dead_rank_is_named() -> None:
    with pytest.raises(MoeEpPeerError, match=r"rank 0 died \(exit code 3\)") as info:
        spawn_local(_die_on_rank_zero, 2, timeout_s=60)
    assert info.value.rank_errors == {}  # a dead rank raised nothing it could report


def _hang_on_rank_one(rank: int, world_size: int, pid_dir: str) -> int:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(600)
    return rank


def test_timeout_kills_every_child(tmp_path: Path) -> None:
    spawn_local(_report_env, 1, 0)  # the first call in a process also starts the forkserver
    start = time.monotonic()
    with pytest.raises(MoeEpTimeoutError) as info:
        spawn_local(_hang_on_rank_one, 2, str(tmp_path), timeout_s=4)
    elapsed = time.monotonic() - start
    assert elapsed < 4 + 10
    assert "rank(s) [1]" in str(info.value) and "world size 2" in str(info.value)
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(2)]
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not multiprocessing.active_children()


def _fail_or_hang(rank: int, world_size: int) -> int:
    if rank == 0:
        raise RuntimeError("rank 0 gives up")
    time.sleep(600)
    return rank


def test_after_a_failure_the_others_get_a_grace_period_then_are_killed() -> None:
    start = time.monotonic()
    with pytest.raises(MoeEpPeerError) as info:
        spawn_local(_fail_or_hang, 3, timeout_s=120, failure_grace_s=1.0)
    assert time.monotonic() - start < 20
    msg = str(info.value)
    assert "rank 0 raised RuntimeError: rank 0 gives up" in msg
    assert "rank(s) [1, 2] were still running 1 s after rank 0 failed" in msg
    assert not isinstance(info.value, MoeEpTimeoutError)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("world_size", "kwargs"),
    [
        (0, {}),
        (True, {}),
        (2, {"timeout_s": 0}),
        (2, {"timeout_s": -1.0}),
        (2, {"failure_grace_s": -1.0}),
    ],
)
def test_usage_errors(world_size: object, kwargs: dict[str, float]) -> None:
    with pytest.raises(MoeEpUsageError):
        spawn_local(_report_env, world_size, 1, **kwargs)  # type: ignore[arg-type]


def _killed_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_a_rank_killed_by_a_signal_is_named_with_it() -> None:
    run = launch_local(_killed_on_rank_one, 2, timeout_s=60)
    assert not run.ok and run.results == {0: 0} and run.stopped == ()
    (failure,) = run.failures
    assert (failure.rank, failure.exitcode, failure.signal_name) == (1, -9, "SIGKILL")
    assert failure.describe() == (
        "rank 1 was killed by SIGKILL (exit code -9), usually the out-of-memory killer"
    )
    with pytest.raises(MoeEpPeerError, match=r"rank 1 was killed by SIGKILL") as info:
        run.values()
    assert info.value.rank_errors == {}


def _record_sigterm_then_hang(rank: int, world_size: int, out_dir: str) -> int:
    def on_term(signum: int, frame: object) -> None:
        Path(out_dir, f"{rank}.term").write_text("SIGTERM")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    Path(out_dir, f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)
    return rank


def _raise_in_the_launcher_once_ranks_run(out_dir: Path, world_size: int) -> None:
    """A stand-in for the CLI's SIGTERM: the launcher's wait is interrupted by an exception."""

    def interrupt(signum: int, frame: object) -> None:
        if len(list(out_dir.glob("*.pid"))) == world_size:
            raise KeyboardInterrupt
        signal.alarm(1)

    signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(1)


def test_an_exception_in_the_launcher_forwards_sigterm_to_every_rank(tmp_path: Path) -> None:
    previous = signal.getsignal(signal.SIGALRM)
    _raise_in_the_launcher_once_ranks_run(tmp_path, 2)
    try:
        with pytest.raises(KeyboardInterrupt):
            spawn_local(_record_sigterm_then_hang, 2, str(tmp_path), timeout_s=120)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert sorted(p.name for p in tmp_path.glob("*.term")) == ["0.term", "1.term"]
    for rank in range(2):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"{rank}.pid").read_text()), 0)
    assert not multiprocessing.active_children()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie (exited, not yet reaped by its parent, the forkserver) is gone too
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


LAUNCHER = """
import os, sys, time
from pathlib import Path
from moe_ep.spawn import spawn_local

def sleep_in_rank(rank, world_size, pid_dir):
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)

if __name__ == "__main__":  # the ranks re-import this file
    spawn_local(sleep_in_rank, 2, sys.argv[1], timeout_s=600)
"""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_ranks_exit_when_their_launcher_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(pid_dir)])
    try:
        deadline = time.monotonic() + 120
        while len(list(pid_dir.glob("*.pid"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "ranks never started"
            time.sleep(0.2)
        time.sleep(0.2)  # the pid files are written: let both writes finish
        pids = [int((pid_dir / f"{r}.pid").read_text()) for r in range(2)]
        assert not any(_gone(pid) for pid in pids)
        proc.kill()  # SIGKILL: the launcher runs no clean-up at all
        proc.wait()
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids):
            assert time.monotonic() < deadline, f"ranks {pids} outlived their launcher"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
        for path in pid_dir.glob("*.pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(path.read_text()), signal.SIGKILL)


def _unpicklable_result(rank: int, world_size: int) -> object:
    return lambda: rank


def test_an_unpicklable_result_is_a_named_failure() -> None:
    run = launch_local(_unpicklable_result, 1, timeout_s=60)
    (failure,) = run.failures
    assert failure.error_type is not None and failure.family == ""
    assert failure.describe().startswith(
        f"rank 0 raised {failure.error_type}: its result could not be sent"
    )

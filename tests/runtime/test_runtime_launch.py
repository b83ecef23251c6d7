"""spawn_local: results in rank order, per-rank env, failures with tracebacks, timeouts."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from moe_ep.errors import MoeEpPeerError, MoeEpTimeoutError, MoeEpUsageError
from moe_ep.launch import spawn_local

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

"""Runtime acquire / release over gloo in spawned ranks (and the in-process error paths)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from moe_ep import BootstrapConfig
from moe_ep.contract import RuntimeRequirements
from moe_ep.errors import (
    MoeEpPeerError,
    MoeEpTimeoutError,
    MoeEpUnavailableError,
    MoeEpUsageError,
)
from moe_ep.spawn import free_port, spawn_local

SPAWN_TIMEOUT = 90.0


def _all_reduce_sum(group: Any, value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t.item())


# ------------------------------------------------------------------ workers (top level)


def _cycle_worker(rank: int, world_size: int) -> dict[str, Any]:
    """torchrun-style env (spawn_local sets it): bootstrap, nest, release, re-bootstrap."""
    import torch.distributed as dist

    from moe_ep import runtime

    out: dict[str, Any] = {"sums": [], "initialised_after": []}
    cfg = BootstrapConfig(world_size, rank, timeout_s=30)
    for _ in range(2):
        outer = runtime.acquire(cfg)
        inner = runtime.acquire(cfg)  # shares the state: no second bootstrap
        out["same_group"] = inner.group is outer.group
        out["refs"] = runtime.active_refcount()
        out["sums"].append(_all_reduce_sum(outer.group, rank + 1))
        inner.barrier()
        inner.release()
        inner.release()  # idempotent: must not drop the outer handle's reference
        out["alive_after_inner"] = dist.is_initialized() and runtime.active_refcount() == 1
        out["meta"] = (outer.rank, outer.world_size, outer.backend, str(outer.device))
        out["timeout_s"] = outer.timeout.total_seconds()
        with outer:
            outer.barrier()
        out["initialised_after"].append(dist.is_initialized())
        out["released_raises"] = _raises(lambda h=outer: h.group, MoeEpUsageError)
    return out


def _late_barrier_worker(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Rank 1 reaches a barrier after the timeout: both ranks get the same error, and the
    runtime is broken on both (later calls raise at once, release is local)."""
    import torch.distributed as dist

    from moe_ep import runtime

    out: dict[str, Any] = {}
    with runtime.acquire(BootstrapConfig(world_size, rank, timeout_s=2)) as rt:
        if rank == 1:
            time.sleep(3.5)
        start = time.monotonic()
        try:
            rt.barrier()
        except MoeEpTimeoutError as exc:
            out["error"] = str(exc)
            out["failed_ranks"] = exc.failed_ranks
        out["elapsed"] = time.monotonic() - start
        try:
            runtime.acquire(BootstrapConfig(world_size + 1, 0))
        except MoeEpUsageError as exc:
            out["conflict"] = str(exc)
        start = time.monotonic()
        try:
            rt.barrier()
        except MoeEpPeerError as exc:
            out["later"] = (type(exc).__name__, str(exc), exc.failed_ranks)
        out["later_s"] = time.monotonic() - start
        out["refs"] = runtime.active_refcount()
        # the store's host (rank 0) stays until the late rank has read the verdict
        Path(tmp, f"read{rank}").touch()
        _wait_for_file(Path(tmp, f"read{1 - rank}"), 20)
        start = time.monotonic()
    out["release_s"] = time.monotonic() - start
    out["after"] = dist.is_initialized()
    return out


def _wait_for_file(path: Path, limit_s: float) -> None:
    end = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.02)


def _raises(fn: Any, exc: type[BaseException]) -> bool:
    try:
        fn()
    except exc:
        return True
    return False


def _init_method_worker(rank: int, world_size: int, port: int) -> float:
    """Explicit init_method, with the torchrun variables removed."""
    from moe_ep import runtime

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(name)
    cfg = BootstrapConfig(world_size, rank, init_method=f"tcp://127.0.0.1:{port}", timeout_s=30)
    with runtime.acquire(cfg) as rt:
        return _all_reduce_sum(rt.group, 10.0**rank)


def _host_group_worker(rank: int, world_size: int) -> dict[str, Any]:
    """The host initialised torch.distributed; moe-ep reuses it and leaves it alone."""
    import datetime

    import torch.distributed as dist

    from moe_ep import runtime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    out: dict[str, Any] = {}
    out["barrier_s"] = []
    for _ in range(2):
        with runtime.acquire(BootstrapConfig(world_size, rank, auto_bootstrap=False)) as rt:
            out["is_world"] = rt.group is dist.group.WORLD
            out["sum"] = _all_reduce_sum(rt.group, rank + 1)
            rt.barrier()
            # the barrier really waits for the late rank, in every runtime lifetime
            if rank == 1:
                time.sleep(0.5)
            start = time.monotonic()
            rt.barrier()
            out["barrier_s"].append(time.monotonic() - start)
    out["host_group_alive"] = dist.is_initialized()
    out["host_group_works"] = _all_reduce_sum(None, 1.0)
    wrong = BootstrapConfig(world_size + 1, rank, auto_bootstrap=False)
    try:
        runtime.acquire(wrong)
    except MoeEpUsageError as exc:
        out["mismatch"] = str(exc)
    dist.destroy_process_group()
    return out


def _given_group_worker(rank: int, world_size: int) -> dict[str, Any]:
    """An EP subgroup made by the host (dist.new_group) is used as the EP group."""
    import datetime

    import torch.distributed as dist

    from moe_ep import runtime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    ep_ranks = [1, 3] if world_size == 4 else list(range(world_size))
    group = dist.new_group(ep_ranks)
    out: dict[str, Any] = {}
    if rank in ep_ranks:
        ep_rank = ep_ranks.index(rank)
        cfg = BootstrapConfig(len(ep_ranks), ep_rank, process_group=group)
        with runtime.acquire(cfg) as rt:
            out["ep_rank"] = rt.rank
            out["uses_group"] = rt.group is group
            out["sum"] = _all_reduce_sum(rt.group, rank)  # global ranks of the EP members
            rt.barrier()
        bad = BootstrapConfig(len(ep_ranks), 1 - ep_rank, process_group=group)
        try:
            runtime.acquire(bad)
        except MoeEpUsageError as exc:
            out["mismatch"] = str(exc)
    dist.barrier()
    out["host_group_alive"] = dist.is_initialized()
    dist.destroy_process_group()
    return out


def _die_before_bootstrap(rank: int, world_size: int, victim: int, out_dir: str) -> None:
    """`victim` exits before bootstrapping; the others report what acquire raised."""
    from moe_ep import runtime

    if rank == victim:
        os._exit(17)
    start = time.monotonic()
    try:
        runtime.acquire(BootstrapConfig(world_size, rank, timeout_s=4))
        msg = "no error"
    except (MoeEpTimeoutError, MoeEpPeerError) as exc:
        msg = f"{type(exc).__name__}: {exc}"
    Path(out_dir, f"{rank}.txt").write_text(f"{time.monotonic() - start:.2f}\n{msg}")


def _die_before_release(rank: int, world_size: int, victim: int, out_dir: str) -> None:
    """Everyone bootstraps; `victim` exits instead of releasing."""
    import torch.distributed as dist

    from moe_ep import runtime

    rt = runtime.acquire(BootstrapConfig(world_size, rank, timeout_s=4))
    rt.barrier()
    if rank == victim:
        os._exit(17)
    start = time.monotonic()
    try:
        rt.release()
        msg = "no error"
    except (MoeEpTimeoutError, MoeEpPeerError) as exc:
        msg = f"{type(exc).__name__}: {exc}"
    after = f"{dist.is_initialized()} {runtime.active_refcount()}"
    Path(out_dir, f"{rank}.txt").write_text(f"{time.monotonic() - start:.2f}\n{msg}\n{after}")


# ------------------------------------------------------------------ multi-rank tests


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bootstrap_cycles(world_size: int) -> None:
    results = spawn_local(_cycle_worker, world_size, timeout_s=SPAWN_TIMEOUT)
    expected_sum = world_size * (world_size + 1) / 2
    for rank, out in enumerate(results):
        assert out["sums"] == [expected_sum, expected_sum]
        assert out["same_group"] and out["refs"] == 2 and out["alive_after_inner"]
        assert out["meta"] == (rank, world_size, "gloo", "cpu")
        assert out["timeout_s"] == 30.0
        # moe-ep created the group, so the last release leaves no process group behind
        assert out["initialised_after"] == [False, False]
        assert out["released_raises"]


@pytest.mark.multirank
def test_barrier_is_bounded_and_names_the_late_rank(tmp_path: Path) -> None:
    results = spawn_local(_late_barrier_worker, 2, str(tmp_path), timeout_s=SPAWN_TIMEOUT)
    for out in results:
        assert "rank(s) [1] failed (rank 1: did not arrive within 2 s)" in out["error"]
        assert out["failed_ranks"] == (1,)
        assert "world size 2" in out["error"] and "timeout 2 s" in out["error"]
        assert "already active" in out["conflict"] and "world_size=3" in out["conflict"]
        # the group counts as gone: a later barrier raises at once, naming the same rank
        kind, message, failed = out["later"]
        assert kind == "MoeEpPeerError" and failed == (1,), out["later"]
        assert "is broken since an earlier failure" in message and "release" in message
        assert out["later_s"] < 0.5
        assert out["refs"] == 1 and out["after"] is False
        assert out["release_s"] < 2.0  # local teardown, no barrier
    assert "this rank arrived after the timeout" in results[1]["error"]
    assert 2 <= results[0]["elapsed"] < 2 + 2 * 0.75 + 1.0  # timeout + 2 x grace + scheduling


@pytest.mark.multirank
def test_explicit_init_method() -> None:
    port = free_port()
    results = spawn_local(_init_method_worker, 3, port, timeout_s=SPAWN_TIMEOUT)
    assert results == [111.0, 111.0, 111.0]


@pytest.mark.multirank
def test_reuses_host_group_and_never_destroys_it() -> None:
    results = spawn_local(_host_group_worker, 2, timeout_s=SPAWN_TIMEOUT)
    for out in results:
        assert out["is_world"] and out["sum"] == 3.0
        assert out["host_group_alive"] and out["host_group_works"] == 2.0
        assert "world size 2" in out["mismatch"] and "world_size=3" in out["mismatch"]
    assert min(results[0]["barrier_s"]) > 0.3


@pytest.mark.multirank
def test_given_process_group() -> None:
    results = spawn_local(_given_group_worker, 4, timeout_s=SPAWN_TIMEOUT)
    for rank in (1, 3):
        out = results[rank]
        assert out["ep_rank"] == [1, 3].index(rank) and out["uses_group"]
        assert out["sum"] == 4.0  # global ranks 1 + 3: only the EP members took part
        assert "BootstrapConfig.process_group" in out["mismatch"]
    for out in results:
        assert out["host_group_alive"]
    assert "sum" not in results[0] and "sum" not in results[2]


def _survivor_reports(out_dir: Path, survivors: list[int]) -> list[tuple[float, str]]:
    reports = []
    for rank in survivors:
        elapsed, msg = (out_dir / f"{rank}.txt").read_text().split("\n", 1)
        reports.append((float(elapsed), msg))
    return reports


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("world_size", "victim"), [(3, 1), (2, 0)], ids=["peer-dies", "store-host-dies"]
)
def test_peer_dies_during_bootstrap(tmp_path: Path, world_size: int, victim: int) -> None:
    start = time.monotonic()
    with pytest.raises(MoeEpPeerError, match=rf"rank {victim} died"):
        spawn_local(
            _die_before_bootstrap,
            world_size,
            victim,
            str(tmp_path),
            timeout_s=SPAWN_TIMEOUT,
            failure_grace_s=SPAWN_TIMEOUT,
        )
    assert time.monotonic() - start < 40
    survivors = [r for r in range(world_size) if r != victim]
    for elapsed, msg in _survivor_reports(tmp_path, survivors):
        assert f"rank(s) [{victim}]" in msg or f"rank {victim}" in msg, msg
        assert "MoeEpTimeoutError" in msg or "MoeEpPeerError" in msg
        assert elapsed < 4 + 6, (elapsed, msg)  # slack for a loaded 2-core box


@pytest.mark.multirank
def test_peer_dies_during_release(tmp_path: Path) -> None:
    with pytest.raises(MoeEpPeerError, match=r"rank 2 died"):
        spawn_local(
            _die_before_release,
            3,
            2,
            str(tmp_path),
            timeout_s=SPAWN_TIMEOUT,
            failure_grace_s=SPAWN_TIMEOUT,
        )
    for elapsed, msg in _survivor_reports(tmp_path, [0, 1]):
        first, after = msg.rsplit("\n", 1)
        assert first.startswith("MoeEpTimeoutError") and "rank(s) [2]" in first, msg
        assert "world size 3" in first and "timeout 4 s" in first
        assert elapsed < 4 + 6, (elapsed, msg)  # slack for a loaded 2-core box
        # the survivor still tore down its own state, so it could bootstrap again
        assert after == "False 0"


# ------------------------------------------------------------------ in-process error paths


@pytest.fixture
def no_rendezvous_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MEGA_SINGLE_GPU_GLOO", raising=False)


def _assert_untouched() -> None:
    import torch.distributed as dist

    from moe_ep import runtime

    assert not dist.is_initialized() and runtime.active_refcount() == 0


@pytest.mark.usefixtures("no_rendezvous_env")
def test_auto_bootstrap_false_without_group() -> None:
    from moe_ep import runtime

    with pytest.raises(MoeEpUsageError, match="auto_bootstrap=False"):
        runtime.acquire(BootstrapConfig(2, 0, auto_bootstrap=False))
    _assert_untouched()


@pytest.mark.usefixtures("no_rendezvous_env")
def test_no_way_to_rendezvous() -> None:
    from moe_ep import runtime

    with pytest.raises(MoeEpUsageError, match=r"world_size=2 needs a rendezvous.*MASTER_ADDR"):
        runtime.acquire(BootstrapConfig(2, 0))
    _assert_untouched()


@pytest.mark.usefixtures("no_rendezvous_env")
@pytest.mark.parametrize(
    ("env", "needle"), [({"RANK": "1"}, "RANK=1"), ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4")]
)
def test_torchrun_env_must_agree(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], needle: str
) -> None:
    from moe_ep import runtime

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # never contacted: the check comes first
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(MoeEpUsageError, match=needle):
        runtime.acquire(BootstrapConfig(2, 0))
    _assert_untouched()


@pytest.mark.usefixtures("no_rendezvous_env")
def test_nvshmem_without_gpu_is_unavailable_before_any_collective() -> None:
    import torch

    from moe_ep import runtime

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a CUDA device")
    # No rendezvous is configured either: reaching it would raise MoeEpUsageError instead.
    with pytest.raises(MoeEpUnavailableError, match=r"NVSHMEM.*no CUDA device"):
        runtime.acquire(BootstrapConfig(2, 0), requirements=RuntimeRequirements(nvshmem=True))
    with pytest.raises(MoeEpUnavailableError, match="CUDA device"):
        runtime.acquire(BootstrapConfig(2, 0), requirements=RuntimeRequirements(cuda=True))
    _assert_untouched()


@pytest.mark.usefixtures("no_rendezvous_env")
def test_bad_arguments() -> None:
    from moe_ep import runtime

    with pytest.raises(MoeEpUsageError, match="BootstrapConfig"):
        runtime.acquire((2, 0))  # type: ignore[arg-type]
    with pytest.raises(MoeEpUsageError, match="requirements"):
        runtime.acquire(BootstrapConfig(1, 0), requirements={"nvshmem": True})  # type: ignore[arg-type]
    with pytest.raises(MoeEpUsageError, match="init_method"):
        runtime.acquire(BootstrapConfig(1, 0, init_method="file:///tmp/x"))
    _assert_untouched()


# ------------------------------------------------------------------ one process, no rendezvous


@pytest.mark.usefixtures("no_rendezvous_env")
def test_world_size_1_needs_no_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    from moe_ep import runtime

    def no_tcp_store(*args: object, **kwargs: object) -> None:
        raise AssertionError("world size 1 must not open a TCPStore")

    monkeypatch.setattr(dist, "TCPStore", no_tcp_store)
    try:
        for _ in range(2):  # a second lifetime in the same process works as the first
            with runtime.acquire(BootstrapConfig(1, 0, timeout_s=5)) as rt:
                assert (rt.rank, rt.world_size, rt.backend, str(rt.device)) == (0, 1, "gloo", "cpu")
                assert dist.is_initialized() and dist.get_world_size(rt.group) == 1
                t = torch.tensor([3.0])
                dist.all_reduce(t, group=rt.group)
                assert t.item() == 3.0
                with runtime.acquire(BootstrapConfig(1, 0)) as inner:  # shares the state
                    assert inner.group is rt.group and runtime.active_refcount() == 2
                start = time.monotonic()
                rt.barrier()
                rt.barrier()
                assert time.monotonic() - start < 1.0  # nobody to wait for
            _assert_untouched()  # the last release destroyed the group moe-ep created
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.usefixtures("no_rendezvous_env")
@pytest.mark.parametrize(
    ("env", "needle"), [({"RANK": "1"}, "RANK=1"), ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2")]
)
def test_world_size_1_still_checks_the_torchrun_env(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], needle: str
) -> None:
    from moe_ep import runtime

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(MoeEpUsageError, match=needle):
        runtime.acquire(BootstrapConfig(1, 0))
    _assert_untouched()

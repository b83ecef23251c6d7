"""The push kernel's peer checks (`peers` of the push kernel) on 2 spawned gloo ranks.

Each rank builds the real kernel class on a real CPU runtime and calls `warmup()`, which runs
`_compile` for real up to the window: the GPU pieces are faked (module build/load, this
rank's device report, `torch.cuda.can_device_access_peer`, the drop's
`sm90_push_p2p_native_atomics`, and `PushPipe.create`, which records that a rank went on to
the window rendezvous). A rank that went on alone would then wait in `warmup()`'s barrier
until the runtime's timeout; the tests require every rank to raise the same error quickly
and none to reach the window.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from moe_ep.spawn import spawn_local

TIMEOUT_S = 20.0  # the runtime's bound on every wait; a one-sided failure would take this long

SCENARIOS: dict[str, dict[str, Any]] = {
    "all_good": {},
    "rank1_no_native_atomics": {"no_atomics": [1]},
    "two_hosts": {"hosts": {1: "node-b"}},
    "rank1_build_fails": {"build_fails": [1]},
    "same_gpu": {"uuids": {1: "GPU-0"}},
}


class _FakeA2A:
    def __init__(self, native_atomics: bool) -> None:
        self.native_atomics = native_atomics
        self.queries: list[tuple[int, int]] = []

    def sm90_push_p2p_native_atomics(self, device: int, peer: int) -> bool:
        self.queries.append((device, peer))
        return self.native_atomics


class _FakePipe:
    keepalive: list[Any]

    def __init__(self) -> None:
        self.keepalive = []

    def prepare_jit(self, weights: Any) -> None:
        pass


def _worker(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, Any]]:
    import torch

    import moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.build as push_build
    import moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.peers as push_peers
    from moe_ep import BootstrapConfig, runtime
    from moe_ep.types import FleetParams, MoEWeightPack
    from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig as Config
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.kernel import (
        Sm90Fp8Fp8Bf16PushCudaKernel as Push,
    )
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.pipe import PushPipe

    created: list[int] = []
    a2a: list[_FakeA2A] = []
    Push.availability = classmethod(lambda cls: (True, ""))  # type: ignore[method-assign]
    PushPipe.create = classmethod(  # type: ignore[method-assign]
        lambda cls, layout, inter, **kw: created.append(layout.rank) or _FakePipe()
    )
    torch.cuda.can_device_access_peer = lambda device, peer: True  # type: ignore[assignment]
    push_build.find_sources = lambda: None  # type: ignore[assignment]
    g = torch.Generator().manual_seed(rank)
    weights = MoEWeightPack(
        w13=torch.randn(1, 256, 256, generator=g).to(torch.bfloat16),
        w2=torch.randn(1, 256, 128, generator=g).to(torch.bfloat16),
    )
    fleet = FleetParams(num_experts=world_size, max_tokens_per_rank=8, hidden_size=256)
    out: dict[str, dict[str, Any]] = {}
    with runtime.acquire(BootstrapConfig(world_size, rank, timeout_s=TIMEOUT_S)) as rt:
        for name in names:
            sc = SCENARIOS[name]

            def build(sources: Any, sc: dict[str, Any] = sc) -> None:
                if rank in sc.get("build_fails", []):
                    raise RuntimeError("nvcc exited with status 1 (fake build failure)")

            def load(built: Any, sc: dict[str, Any] = sc) -> tuple[Any, Any]:
                a2a.append(_FakeA2A(rank not in sc.get("no_atomics", [])))
                return a2a[-1], None

            def report(device: Any, sc: dict[str, Any] = sc) -> Any:
                host = sc.get("hosts", {}).get(rank, "node-a")
                uuid = sc.get("uuids", {}).get(rank, f"GPU-{rank}")
                return push_peers.PeerReport(host, rank, uuid, world_size)

            push_build.build_modules = build  # type: ignore[assignment]
            push_build.load_modules = load  # type: ignore[assignment]
            push_peers.local_report = report  # type: ignore[assignment]
            created.clear()
            kernel = Push(config=Config(top_k=2), fleet=fleet, runtime=rt, weights=weights)
            start = time.monotonic()
            result: dict[str, Any] = {}
            try:
                kernel.warmup()
                result["raised"] = None
            except Exception as exc:
                result["raised"] = type(exc).__name__
                result["message"] = str(exc)
                result["cause"] = repr(exc.__cause__)
            result["elapsed"] = time.monotonic() - start
            result["window"] = list(created)
            result["queries"] = list(a2a[-1].queries) if a2a and "build_fails" not in sc else []
            kernel.destroy()
            rt.barrier()
            out[name] = result
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    # gloo on CPU also where GPUs are visible (the GPU check runs this test too)
    return spawn_local(_worker, 2, list(SCENARIOS), timeout_s=120, env={"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.multirank
def test_good_peers_pass_and_each_rank_probes_its_peer(results) -> None:
    for rank, res in enumerate(results):
        r = res["all_good"]
        assert r["raised"] is None, r
        assert r["window"] == [rank]
        assert r["queries"] == [(rank, 1 - rank)]


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("scenario", "needles"),
    [
        (
            "rank1_no_native_atomics",
            ["rank 1 -> peer rank 0", "no NVLink-native system-scope atomics between device 1"],
        ),
        ("two_hosts", ["spans 2 hosts", "rank 1 on 'node-b'", "one node only"]),
        ("rank1_build_fails", ["rank 1: RuntimeError: nvcc exited with status 1"]),
        ("same_gpu", ["ranks 0 and 1 use the same GPU (GPU-0)"]),
    ],
)
def test_a_bad_pair_fails_every_rank_together_before_the_window(
    results, scenario: str, needles: list[str]
) -> None:
    for rank, res in enumerate(results):
        r = res[scenario]
        assert r["raised"] == "MoeEpUnavailableError", (rank, r)
        assert f"seen from rank {rank} of 2" in r["message"]
        for needle in needles:
            assert needle in r["message"], (rank, r["message"])
        assert r["window"] == [], (rank, r)  # nobody went on to the window rendezvous
        assert r["elapsed"] < TIMEOUT_S / 2, (rank, r)  # no rank sat out a timeout


@pytest.mark.multirank
def test_the_failing_rank_chains_its_own_error(results) -> None:
    assert "nvcc exited with status 1" in results[1]["rank1_build_fails"]["cause"]
    assert results[0]["rank1_build_fails"]["cause"] == "None"


def _late_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 reaches the check after the runtime's timeout: rank 0's wait is bounded."""
    import moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.peers as push_peers
    from moe_ep import BootstrapConfig, runtime

    out: dict[str, Any] = {}
    with runtime.acquire(BootstrapConfig(world_size, rank, timeout_s=2)) as rt:
        if rank == 1:
            time.sleep(3.5)
        start = time.monotonic()
        try:
            push_peers.agree_on_peers(
                rt, push_peers.PeerReport("node-a", rank, f"GPU-{rank}", 2), lambda d, p: None
            )
            out["raised"] = None
        except Exception as exc:
            out["raised"] = type(exc).__name__
            out["message"] = str(exc)
        out["elapsed"] = time.monotonic() - start
    return out


@pytest.mark.multirank
def test_a_peer_that_never_arrives_is_a_bounded_timeout() -> None:
    res = spawn_local(_late_worker, 2, timeout_s=60, env={"CUDA_VISIBLE_DEVICES": ""})
    assert res[0]["raised"] == "MoeEpTimeoutError", res[0]
    assert "peer check: rank(s) [1] failed" in res[0]["message"], res[0]
    assert "world size 2, timeout 2 s" in res[0]["message"], res[0]
    assert res[0]["elapsed"] < 2 + 3, res[0]
    # the late rank does not go on: it reads the verdict, or finds rank 0 (the store) gone
    assert res[1]["raised"] in ("MoeEpTimeoutError", "MoeEpPeerError"), res[1]

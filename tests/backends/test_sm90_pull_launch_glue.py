"""The never-run pull launch path (`Sm90Fp8Fp8Bf16PullCutedslKernel._compile` / `_launch`)
on CPU, against what the sm90 drop's runner does (`moe_hopper_fp8/mega_runner.py`:
`generate_inputs`, `allocate_workspaces`, `run_kernel`) and what a multi-layer host needs.

cutlass, NVSHMEM and cuda-bindings are the recording fakes of `cute_fakes`; the drop's
kernel class is a stand-in that records its constructor and lays out the combine cells as
the real one (whose region table the compile-only check reads). Our code runs for real.
"""

from __future__ import annotations

import pytest
import torch
from backend_testing import FakeRuntime, routed_tensors
from cute_fakes import (
    FakeStream,
    assert_heap_bound,
    install_fake_pull_kernel,
)

import moe_ep_sm90.common.pull_drop as pull_drop
import moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.kernel as pull
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig as Config

H, I, E, T, K, WORLD, RANK = 256, 128, 4, 8, 2, 2, 1  # noqa: E741 - glossary names
WEIGHTS = ("fc1_weight", "fc1_weight_sf", "fc2_weight", "fc2_weight_sf")


@pytest.fixture
def gpu(monkeypatch):
    gpu = install_fake_pull_kernel(monkeypatch, world_size=WORLD, rank=RANK)
    return gpu


def _layer(runtime, seed=0):
    g = torch.Generator().manual_seed(seed)
    el = E // WORLD
    return pull.Sm90Fp8Fp8Bf16PullCutedslKernel(
        config=Config(top_k=K),
        fleet=FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H),
        runtime=runtime,
        weights=MoEWeightPack(
            w13=torch.randn(el, 2 * I, H, generator=g).to(torch.bfloat16),
            w2=torch.randn(el, H, I, generator=g).to(torch.bfloat16),
        ),
    )


def _forward(kernel, n=3):
    t = routed_tensors(n, K, H, E)
    out = torch.zeros(n, H, dtype=torch.bfloat16)
    return kernel.compute_staged(staged=kernel.stage_inputs(tensors=t, output=out))


def _weights_of(launch):
    return {name: launch[name].tensor for name in WEIGHTS}


def test_each_layer_of_a_shared_geometry_launches_with_its_own_weights(gpu):
    rt = FakeRuntime(rank=RANK, world_size=WORLD)
    a, b = _layer(rt, seed=1), _layer(rt, seed=2)
    a.warmup()
    b.warmup()
    assert len(gpu.compiles) == 1  # one compiled kernel and workspace set for both
    _forward(a)
    _forward(b)
    _forward(a)
    la, lb, la2 = gpu.compiled.launches
    for launch, layer in ((la, a), (lb, b), (la2, a)):
        got = _weights_of(launch)
        assert got["fc1_weight"] is layer.prepared.w13
        assert got["fc1_weight_sf"] is layer.prepared.w13_scales
        assert got["fc2_weight"] is layer.prepared.w2
        assert got["fc2_weight_sf"] is layer.prepared.w2_scales
    assert not torch.equal(a.prepared.w13.view(torch.uint8), b.prepared.w13.view(torch.uint8))
    # the rest of the launch is the pooled compile's: same staging buffers for both layers
    assert la["activation"].tensor is lb["activation"].tensor
    # the runner's _to_cute: K-major weights, stride 1 on dim 1
    assert all(la[name].leading_dim == 1 for name in ("fc1_weight", "fc2_weight"))
    a.destroy()
    b.destroy()


def test_the_launch_runs_on_the_stream_current_at_the_launch(gpu):
    rt = FakeRuntime(rank=RANK, world_size=WORLD)
    layer = _layer(rt)
    layer.warmup()  # compiled on stream 7
    ((_, args),) = gpu.compiles
    assert args["stream"] == FakeStream(7)
    gpu.stream = 11  # forwards on a framework's stream
    _forward(layer)
    (launch,) = gpu.compiled.launches
    assert launch["stream"] == FakeStream(11)
    assert "max_active_clusters" not in launch
    layer.destroy()


def test_padded_slots_combine_cells_are_zeroed_before_each_launch(gpu):
    rt = FakeRuntime(rank=RANK, world_size=WORLD)
    layer = _layer(rt)
    layer.warmup()
    entry = layer._entry()
    cells = entry.combine
    assert cells.shape == (T, K, H) and cells.dtype == torch.bfloat16
    # the stand-in kernel lays the region 256 bytes into the shared workspace
    assert cells.data_ptr() == entry.shared_workspace.data_ptr() + 256
    cells.fill_(3.0)  # what earlier launches left in every cell
    seen = {}

    def at_launch(kwargs):
        seen["cells"] = cells.clone()
        seen["ids"] = entry.staging["topk_idx"].clone()

    gpu.compiled.on_launch = at_launch
    n = 3
    _forward(layer, n=n)
    ids, c = seen["ids"], seen["cells"]
    padded = ids[:n] < 0
    assert padded.any() and (~padded).any()
    assert (c[:n][padded] == 0).all()
    assert (c[:n][~padded] == 3.0).all()  # valid slots: the kernel writes them
    assert (c[n:] == 3.0).all()  # rows past n are never read back
    layer.destroy()


def test_compute_refuses_inputs_another_layer_overwrote(gpu):
    rt = FakeRuntime(rank=RANK, world_size=WORLD)
    a, b = _layer(rt, seed=1), _layer(rt, seed=2)
    t = routed_tensors(3, K, H, E)
    out = torch.zeros(3, H, dtype=torch.bfloat16)
    staged_a = a.stage_inputs(tensors=t, output=out)
    b.stage_inputs(tensors=t, output=out)
    with pytest.raises(MoeEpUsageError, match="overwritten"):
        a.compute_staged(staged=staged_a)
    staged = a.stage_inputs(tensors=t, output=out)
    a.compute_staged(staged=staged)
    with pytest.raises(MoeEpUsageError, match="overwritten"):  # each handle computes once
        a.compute_staged(staged=staged)
    a.destroy()
    b.destroy()


def test_launch_path_is_the_core_base_class(gpu):
    from moe_ep.backends.support.cutedsl.mega_kernel import CutedslMegaKernel

    cls = pull.Sm90Fp8Fp8Bf16PullCutedslKernel
    for name in ("stage_inputs", "compute_staged", "_compile", "_build_weight_args", "_launch"):
        assert getattr(cls, name) is getattr(CutedslMegaKernel, name), name


def test_destroy_waits_for_the_device_before_the_barrier_and_the_free(gpu, monkeypatch):
    events: list[str] = []
    rt = FakeRuntime(rank=RANK, world_size=WORLD)
    layer = _layer(rt)
    layer.warmup()
    _forward(layer)
    monkeypatch.setattr(type(layer), "_wait_device", lambda self: events.append("sync"))
    monkeypatch.setattr(type(rt), "barrier", lambda self: events.append("barrier"))
    monkeypatch.setattr(pull._POOL, "free", lambda entry: events.append("free"))
    layer.destroy()
    assert events == ["sync", "barrier", "free"]


def test_peer_offsets_come_from_the_peer_buffers_base(gpu):
    gpu.stale_peer_extra = 4096  # nvshmem4py tracks a larger, reused peer buffer
    rt = FakeRuntime(rank=RANK, world_size=WORLD)
    layer = _layer(rt)
    layer.warmup()
    entry = layer._entry()
    shared = entry.shared_workspace
    want = tuple(
        0 if p == RANK else gpu.peers[id(shared)][p].data_ptr() - shared.data_ptr()
        for p in range(WORLD)
    )
    assert entry.peer_map.kwargs == {
        "base_addr": shared.data_ptr(),
        "offsets": want,
        "rank_idx": RANK,
        "num_max_ranks": WORLD,
    }
    layer.destroy()


def test_a_drop_without_the_combine_region_fails_before_allocating(gpu, monkeypatch):
    monkeypatch.setattr(pull_drop, "COMBINE_REGION", "renamed_in_a_new_drop")
    layer = _layer(FakeRuntime(rank=RANK, world_size=WORLD))
    with pytest.raises(RuntimeError, match=r"renamed_in_a_new_drop.*moe_ep_sm90 must be updated"):
        layer.warmup()
    assert gpu.symmetric == []  # nothing allocated on the symmetric heap


def test_top_k_above_a_warp_is_refused_before_anything_runs():
    # The sm90 drop's dispatch maps a token's slots onto one warp's lanes (token_comm.py:
    # tokens_per_warp = 32 // num_topk): above 32 its loop never advances (a GPU hang).
    with pytest.raises(MoeEpUsageError, match=r"top_k must be <= 32.*got 33"):
        Config(top_k=33).check_problem(**_problem(33))
    Config(top_k=32).check_problem(**_problem(32))


def _problem(top_k):
    return dict(
        world_size=1,
        num_experts=64,
        hidden_size=H,
        intermediate_size=I,
        top_k=top_k,
        max_tokens_per_rank=T,
    )


def test_symmetric_buffers_past_the_nvshmem_heap_are_refused_before_allocating(gpu, monkeypatch):
    # shared workspace (the stand-in's 256 + T*k*H*2 + 64) plus the symmetric staging:
    # activation T*H e4m3, scales T*ceil4(H/128) fp32, ids T*k int64, weights T*k fp32,
    # output T*H bf16
    need = (256 + T * K * H * 2 + 64) + T * H + T * 4 * 4 + T * K * 8 + T * K * 4 + T * H * 2
    layer = _layer(FakeRuntime(rank=RANK, world_size=WORLD))
    assert_heap_bound(gpu, monkeypatch, need, layer.warmup)
    layer.destroy()

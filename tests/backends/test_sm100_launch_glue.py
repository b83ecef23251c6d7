"""The never-run sm100 launch path (`CutedslMegaKernel._compile` / `_launch`) on CPU, checked
line by line against what the drop's own runners do (`moe_nvfp4_swapab/mega_runner.py`,
`moe_mxfp8_glu/mega_runner.py`, `run_kernel` / `allocate_workspaces` / `generate_inputs`).

cutlass, NVSHMEM and cuda-bindings are recording fakes (`sm100_fakes`); our code runs for
real: kernel construction, allocations, staging, peer offsets, argument conversion, compile
and launch. The expected values below are the runners' (cited), not read back from ours.
"""

from __future__ import annotations

import sys

import pytest
import torch
from backend_testing import FakeRuntime, routed_tensors
from cute_fakes import assert_heap_bound
from sm100_fakes import FakeCuteTensor, FakePtr, FakeStream, drop_signature, install_fake_gpu

from moe_ep.backends.support.cutedsl.mega_kernel import CutedslMegaKernel
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm100 import (
    Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
    Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.kernel import (
    Sm100Mxfp8Mxfp8Bf16CutedslKernel,
)
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.kernel import (
    Sm100Nvfp4Nvfp4Bf16CutedslKernel,
)

H, I, E, T, K, WORLD, RANK = 256, 128, 4, 8, 2, 2, 1  # noqa: E741 - glossary names
KINDS = {
    "nvfp4": (Sm100Nvfp4Nvfp4Bf16CutedslKernel, Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig),
    "mxfp8": (Sm100Mxfp8Mxfp8Bf16CutedslKernel, Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig),
}


def _make(kind, runtime):
    """Rank `RANK` of `WORLD`: E experts in the fleet, E / WORLD in the pack."""
    cls, cfg = KINDS[kind]
    g = torch.Generator().manual_seed(0)
    el = E // WORLD
    return cls(
        config=cfg(top_k=K, gate_up_clamp=7.0),
        fleet=FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H),
        runtime=runtime,
        weights=MoEWeightPack(
            w13=torch.randn(el, 2 * I, H, generator=g).to(torch.bfloat16),
            w2=torch.randn(el, H, I, generator=g).to(torch.bfloat16),
        ),
    )


@pytest.fixture(params=sorted(KINDS))
def setup(request, monkeypatch):
    kind = request.param
    gpu = install_fake_gpu(monkeypatch, world_size=WORLD, rank=RANK)
    monkeypatch.setattr(KINDS[kind][0], "availability", classmethod(lambda c: (True, "")))
    kernel = _make(kind, FakeRuntime(rank=RANK, world_size=WORLD))
    yield kind, kernel, gpu
    kernel.destroy()


def _forward(kernel, n=3):
    t = routed_tensors(n, K, H, E)
    out = torch.zeros(n, H, dtype=torch.bfloat16)
    return kernel.compute_staged(staged=kernel.stage_inputs(tensors=t, output=out))


def _leading_dim(t: torch.Tensor) -> int:
    """`cutlass.torch.get_leading_dim` as the runners call it: the stride-1 dim."""
    (dim,) = [d for d in range(t.dim()) if t.stride(d) == 1]
    return dim


def test_kernel_constructor_matches_the_runner(setup):
    kind, kernel, gpu = setup
    kernel.warmup()
    (k,) = gpu.kernels
    kw = k.kwargs
    assert set(kw) <= set(drop_signature(kind, "__init__")), "unknown constructor keyword"
    el = E // WORLD
    # run_kernel: static_expert_shape = (num_experts_per_rank, intermediate (2I), hidden)
    assert kw["static_expert_shape"] == (el, 2 * I, H) and kw["hidden"] == H
    assert (kw["world_size"], kw["num_topk"], kw["max_tokens_per_rank"]) == (WORLD, K, T)
    assert kw["gate_up_clamp"] == 7.0 and kw["load_balance_mode"] == "static"
    assert kw["force_static_sched"] is True and kw["token_back_mode"] == "epi_warps"
    # the api's: the nvfp4 epilogue tile; mxfp8 the runner's c_token_padding (its col
    # requant takes 128 or 256 only)
    assert kw["sf_padding_block"] == 128
    assert kw["token_padding_block"] == (64 if kind == "nvfp4" else 128)
    # as the runners construct them: the separate, non-persistent top-k reduce
    assert kw["skip_topk_reduce"] is False and kw["topk_reduce_persistent"] is False
    cluster = 1 if kind == "nvfp4" else 2  # 1-CTA swap-AB; 2-CTA (2, 1, 1) cluster
    assert kw["cluster_shape_mnk"] == (cluster, 1, 1)
    assert kw["use_2cta_instrs"] is (kind == "mxfp8")
    assert kw["group_hint"] == 148 // cluster  # group_hint None -> max_active_clusters
    if kind == "nvfp4":
        assert kw["mma_tiler_mnk"] == (128, 128, 256)
        assert kw["apply_topk_in_fc1"] is True  # ref_compute_graph "deepgemm" (default)
        assert kw["in_kernel_fc2_reduce"] is False and kw["non_ubulk_fc2_store"] is True
        assert kw["fc2_output_dtype"] == "cutlass.BFloat16"
        assert kw["combine_format"] == "CombineFormat(bf16)"
        assert kw["enable_fc1_activation_per_token_scale"] is False  # not offered
    else:
        assert kw["mma_tiler_mnk"] == (256, 256, 128)
        assert kw["local_rank"] == RANK and kw["fc2_in_kernel_topk_reduce"] is False
        assert kw["ab_dtype"] == "cutlass.Float8E4M3FN" and kw["sf_vec_size"] == 32


def test_buffers_placement_dtypes_and_zeroing_match_the_runner(setup):
    kind, kernel, gpu = setup
    kernel.warmup()
    ((_, args),) = gpu.compiles
    sym = {id(t) for t in gpu.symmetric}

    def torch_of(name):
        a = args[name]
        return a.tensor if hasattr(a, "tensor") else None

    # generate_inputs: activation / activation_sf / topk_idx / topk_weights on the symmetric
    # heap as byte buffers viewed as the kernel dtype; output_activation local (separate
    # top-k reduce); weights local.
    h_sf = -(-H // (16 if kind == "nvfp4" else 32))
    want = {
        "activation": (
            ((T, H // 2), torch.float4_e2m1fn_x2) if kind == "nvfp4"
            else ((T, H), torch.float8_e4m3fn)
        ),
        "activation_sf": (
            (T, -(-h_sf // 4) * 4),
            torch.float8_e4m3fn if kind == "nvfp4" else torch.float8_e8m0fnu,
        ),
        "topk_idx": ((T, K), torch.int64),
        "topk_weights": ((T, K), torch.float32),
        "output_activation": ((T, H), torch.bfloat16),
    }  # fmt: skip
    for name, (shape, dtype) in want.items():
        t = torch_of(name)
        assert (tuple(t.shape), t.dtype) == (shape, dtype), name
        symmetric = t.untyped_storage().data_ptr() in {s.data_ptr() for s in gpu.symmetric}
        assert symmetric is (name != "output_activation"), name
    assert int(torch_of("topk_idx").min()) == -1 == int(torch_of("topk_idx").max())
    for name in ("activation", "activation_sf", "topk_weights"):
        assert not torch_of(name).view(torch.uint8).any(), name  # _sym_zeros*
    # allocate_workspaces: local zeroed CUDA, shared zeroed symmetric, sizes from the kernel
    (k,) = gpu.kernels
    local_bytes, shared_bytes = k.sizes
    shared = gpu.symmetric[0]
    assert shared.numel() == shared_bytes and not shared.any() and id(shared) in sym
    assert len(gpu.symmetric) == 5  # shared workspace + the four staged inputs
    if kind == "nvfp4":  # raw uint8 gmem pointers, 16-byte aligned
        assert args["shared_workspace"] == FakePtr("cutlass.Uint8", shared.data_ptr(), "gmem", 16)
        local_ptr = args["local_workspace"]
        assert local_ptr.assumed_align == 16 and local_ptr.memspace == "gmem"
        local = kernel._pooled.local_workspace
        assert local.data_ptr() == local_ptr.address
    else:  # uint8 tensors: local static layout, shared dynamic on dim 0; fc1_c None
        lw, sw = args["local_workspace"], args["shared_workspace"]
        assert lw.leading_dim is None and lw.tensor.numel() == local_bytes
        assert sw.leading_dim == 0 and sw.tensor is shared
        local = lw.tensor
        assert args["fc1_c"] is None
        # run_kernel's col-quant outputs: local CUDA, [pool, H] fp8 and H * pool / 32 bytes
        pool = k.pool_token_capacity
        data, sf = args["col_quant_data"].tensor, args["col_quant_sf"].tensor
        assert (tuple(data.shape), data.dtype) == ((pool, H), torch.float8_e4m3fn)
        assert (tuple(sf.shape), sf.dtype) == ((H * pool // 32,), torch.uint8)
        heap = {s.data_ptr() for s in gpu.symmetric}
        mine = {data.untyped_storage().data_ptr(), sf.untyped_storage().data_ptr()}
        assert mine.isdisjoint(heap)
    assert local.numel() == local_bytes and not local.any() and id(local) not in sym
    # every tensor argument: assumed_align 16 (4 for the per-expert fp32 vectors), dynamic
    # layout on the stride-1 dim (`_to_cute`)
    for name, ct in args.items():
        if not isinstance(ct, FakeCuteTensor) or name.endswith("_workspace"):
            continue
        align = 4 if name in ("fc1_alpha", "fc2_alpha", "fc1_norm_const") else 16
        assert ct.assumed_align == align, name
        assert ct.leading_dim == _leading_dim(ct.tensor), name
        assert ct.tensor.data_ptr() % align == 0, name


def test_call_arguments_peer_map_and_launch_match_the_runner(setup):
    kind, kernel, gpu = setup
    gpu.stream = 5
    kernel.warmup()
    ((_, args),) = gpu.compiles
    assert set(args) == set(drop_signature(kind, "__call__"))
    assert args["max_active_clusters"] == 148 // (1 if kind == "nvfp4" else 2)
    assert args["stream"] == FakeStream(5)
    # _compute_peer_offsets over the shared workspace: base = its address, offsets[r] = peer
    # r's address minus base (0 for the own rank), passed through SymBufferHost
    shared = gpu.symmetric[0]
    peers = gpu.peers[id(shared)]
    pm = args["peer_rank_ptr_mapper_host"].kwargs
    assert pm == {
        "base_addr": shared.data_ptr(),
        "offsets": tuple(p.data_ptr() - shared.data_ptr() for p in peers),
        "rank_idx": RANK,
        "num_max_ranks": WORLD,
    }
    assert pm["offsets"][RANK] == 0 and all(pm["offsets"][r] != 0 for r in range(WORLD - 1))
    _forward(kernel)
    (launch,) = gpu.compiled.launches
    # the runner launches with runtime_kwargs: the compile kwargs without max_active_clusters
    assert set(launch) == set(args) - {"max_active_clusters"}
    assert all(launch[n] is args[n] for n in launch if n != "stream")


def test_each_launch_runs_on_the_stream_current_then(setup):
    # staging copies and the output copy-out are issued on the current stream; a kernel
    # launched on the stream of compile time (warmup) would race them
    _, kernel, gpu = setup
    gpu.stream = 5
    kernel.warmup()
    gpu.stream = 11
    _forward(kernel)
    gpu.stream = 12
    _forward(kernel)
    assert [ln["stream"] for ln in gpu.compiled.launches] == [FakeStream(11), FakeStream(12)]


def test_padded_slots_combine_cells_are_zeroed_before_each_launch(setup):
    # the top-k reduce sums all k cells of a row; a padded slot's cell is written by nobody
    _, kernel, gpu = setup
    kernel.warmup()
    cells = kernel._pooled.combine
    assert cells.shape == (T, K, H) and cells.dtype == torch.bfloat16
    assert cells.data_ptr() == gpu.symmetric[0].data_ptr() + 256  # the kernel's region
    seen = []
    gpu.compiled.on_launch = lambda kw: seen.append(cells.clone())
    cells.fill_(3.0)  # what an earlier launch left
    _forward(kernel, n=3)  # routed_tensors: row 0, slot 1 padded
    (at_launch,) = seen
    assert not at_launch[0, 1].any()
    at_launch[0, 1] = 3.0
    assert bool((at_launch == 3.0).all())  # nothing else touched (rows >= n included)


def test_peer_offsets_survive_a_stale_larger_peer_buffer(setup):
    # nvshmem4py's get_peer_tensor views the peer buffer as the tensor's shape, which fails
    # when its tracker still holds a larger buffer at a reused address
    _, kernel, gpu = setup
    gpu.stale_peer_extra = 4096
    kernel.warmup()
    ((_, args),) = gpu.compiles
    shared = gpu.symmetric[0]
    want = tuple(p.data_ptr() - shared.data_ptr() for p in gpu.peers[id(shared)])
    assert args["peer_rank_ptr_mapper_host"].kwargs["offsets"] == want


def test_destroy_frees_every_symmetric_buffer_once(setup):
    _, kernel, gpu = setup
    kernel.warmup()
    kernel.destroy()
    assert [id(t) for t in gpu.freed] == [id(t) for t in gpu.symmetric]
    kernel.destroy()
    assert len(gpu.freed) == 5


def test_destroy_waits_for_the_device_before_the_barrier_and_the_free(setup, monkeypatch):
    # the runners: torch.cuda.synchronize(); barrier; free (a host barrier alone lets a rank
    # free symmetric memory a peer's kernel still writes)
    _, kernel, _ = setup
    events: list[str] = []
    monkeypatch.setattr(type(kernel), "_wait_device", lambda self: events.append("sync"))
    monkeypatch.setattr(type(kernel.runtime), "barrier", lambda self: events.append("barrier"))
    core = sys.modules["nvshmem.core"]
    monkeypatch.setattr(core, "free_tensor", lambda t: events.append("free"))
    kernel.warmup()
    _forward(kernel)
    events.clear()
    kernel.destroy()
    assert events == ["sync", "barrier"] + ["free"] * 5


def test_layers_sharing_an_entry_launch_with_their_own_weights(setup):
    # one compiled kernel and one set of buffers per geometry; the weights (and nvfp4's
    # per-expert alphas) are each layer's own
    kind, kernel, gpu = setup
    other = _make(kind, kernel.runtime)
    kernel.warmup()
    other.warmup()
    assert len(gpu.compiles) == 1
    _forward(other)
    _forward(kernel)
    _forward(other)
    names = set(kernel._weight_tensors())
    assert {"fc1_weight", "fc1_weight_sf", "fc2_weight", "fc2_weight_sf"} <= names
    for launch, layer in zip(gpu.compiled.launches, (other, kernel, other), strict=True):
        for name, t in layer._weight_tensors().items():
            arg = launch[name]
            assert arg.tensor.data_ptr() == t.data_ptr(), name
            assert arg.leading_dim == _leading_dim(arg.tensor), name
    other.destroy()


def test_staging_of_a_second_layer_refuses_the_first_layers_compute(setup):
    kind, kernel, gpu = setup
    other = _make(kind, kernel.runtime)
    t = routed_tensors(3, K, H, E)
    out = torch.zeros(3, H, dtype=torch.bfloat16)
    first = kernel.stage_inputs(tensors=t, output=out)
    second = other.stage_inputs(tensors=t, output=out.clone())
    assert len(gpu.compiles) == 1  # one pooled entry, one set of staging buffers
    with pytest.raises(MoeEpUsageError, match="overwritten"):
        kernel.compute_staged(staged=first)
    other.compute_staged(staged=second)
    with pytest.raises(MoeEpUsageError, match="overwritten"):
        other.compute_staged(staged=second)  # once
    other.destroy()


def test_launch_path_is_the_base_class(setup):
    """Core's CuTe DSL base (shared with the sm90 pull kernel) runs the lifecycle."""
    _, kernel, _ = setup
    assert type(kernel)._compile is CutedslMegaKernel._compile
    assert type(kernel)._launch is CutedslMegaKernel._launch


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_top_k_above_32_is_refused_before_anything_is_built(kind):
    # the runners refuse num_topk > 32; the drop's dispatch would spin forever on it
    # (tokens_per_warp = 32 // num_topk == 0 never advances its token loop)
    _, cfg = KINDS[kind]
    geometry = dict(
        hidden_size=H, intermediate_size=I, num_experts=64, world_size=1, max_tokens_per_rank=T
    )
    cfg().check_problem(top_k=32, **geometry)
    with pytest.raises(MoeEpUsageError, match=r"top_k must be <= 32.*got 33"):
        cfg().check_problem(top_k=33, **geometry)
    with pytest.raises(MoeEpUsageError, match="got 33"):
        cfg(top_k=33).check_problem(top_k=33, **geometry)


def test_a_shared_workspace_past_a_32_bit_extent_is_refused_before_allocating(setup, monkeypatch):
    # The mxfp8 kernel takes its shared workspace as a tensor with a dynamic 32-bit extent
    # (the nvfp4 one as a raw pointer): at 2**31 bytes it would wrap. Refused on every rank
    # alike (same sizes), before any buffer is allocated.
    kind, kernel, gpu = setup
    kernel_cls = type(kernel)._make_kernel
    big = 2**31

    def make(self, g):
        k, api, clusters = kernel_cls(self, g)
        k.sizes = (1024, big)
        return k, api, clusters

    monkeypatch.setattr(type(kernel), "_make_kernel", make)
    if kind == "mxfp8":
        with pytest.raises(MoeEpUsageError, match=r"2147483648 bytes.*32-bit extent.*<= about"):
            kernel.warmup()
        assert gpu.symmetric == []
    else:  # a raw pointer: no such limit
        kernel._check_workspace_sizes(kernel.geometry, 1024, big)


def test_symmetric_buffers_past_the_nvshmem_heap_are_refused_before_allocating(setup, monkeypatch):
    # shared workspace (the stand-in's 256 + T*k*H*2 + 64) plus the symmetric inputs:
    # activation (nvfp4: two per byte), one scale byte per 16 / 32 columns padded to 4,
    # int64 ids, fp32 weights
    kind, kernel, gpu = setup
    block = 16 if kind == "nvfp4" else 32
    act = T * H // 2 if kind == "nvfp4" else T * H
    sf = T * (-(-(H // block) // 4) * 4)
    need = (256 + T * K * H * 2 + 64) + act + sf + T * K * 8 + T * K * 4
    assert_heap_bound(gpu, monkeypatch, need, kernel.warmup)

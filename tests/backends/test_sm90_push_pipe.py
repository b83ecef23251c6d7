"""The push kernel's launch path on CPU: window layout, one round's module calls, lifecycle.

The TVM-FFI modules are replaced by recorders, so what is tested is our own logic: the
layout arithmetic, that a round calls the drop's functions in the protocol's order with the
21 layout scalars, the pooling / ref-counting / staging of the kernel class, and the
errors. Nothing here has run on a GPU.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
import torch
from backend_testing import fake_gpu_pieces, make_kernel

import moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.kernel as push
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import MoEEpTensors
from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig as Config
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.pipe import (
    GemmBuffers,
    PushPipe,
    PushScratch,
    PushWeights,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.window import push_window

H, I, E, T = 256, 128, 4, 8  # noqa: E741 - the glossary names (I = intermediate)

ROUND = [
    "sm90_push_bump_tag",
    "sm90_push_wait_acks",
    "sm90_push_dispatch_fp8",
    "sm90_push_wait_prefix",
    "sm90_push_compact",
    "moe_gemm",
    "sm90_silu_mul_quant_grouped",
    "moe_gemm",
    "sm90_push_combine",
    "sm90_push_wait_combine",
    "sm90_combine_reduce",
    "sm90_push_ack",
]


def test_layout_regions_are_ordered_aligned_and_large_enough():
    ep, e, k, t = 4, 3, 8, 16
    lay = push_window(ep_size=ep, rank=1, num_local_experts=e, hidden=H, top_k=k, token_capacity=t)
    routes = ep * t * k
    # (offset, bytes the region must hold), in window order
    regions = [
        (lay.pool_offset, routes * H),
        (lay.pool_sc_offset, routes * (H // 128) * 4),
        (lay.pool_meta_offset, routes * 16),
        (lay.pool_head_offset, 16),  # reservation head + abort cell
        (lay.base_cells_offset, ep * 8),
        (lay.count_cells_offset, e * ep * 8),
        (lay.cdone_cells_offset, ep * 8),
        (lay.ack_cells_offset, ep * 8),
        (lay.combine_offset, t * k * H * 2),  # bf16 combine inbox
        (lay.cfp8_offset, 0),
        (lay.csc_offset, 0),
        (lay.total_bytes, 0),
    ]
    for (off, need), (nxt, _) in itertools.pairwise(regions):
        assert off % 128 == 0
        assert need <= nxt - off < need + 128
    assert lay.m_cap == routes and lay.pool_rows == routes
    args = lay.launch_args(0xABC)
    assert len(args) == 21 and args[0] == 0xABC and args[2] == 1 and args[-1] == lay.csc_offset
    fp8 = push_window(
        ep_size=ep,
        rank=1,
        num_local_experts=e,
        hidden=H,
        top_k=k,
        token_capacity=t,
        fp8_combine=True,
    )
    assert fp8.cfp8_offset == fp8.combine_offset  # no bf16 inbox
    assert fp8.csc_offset - fp8.cfp8_offset >= t * k * H


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 3}, "top_k"),
        ({"hidden": 192}, "hidden"),
        ({"ep_size": 33}, "ep_size"),
        ({"rank": 4}, "rank"),
    ],
)
def test_layout_rejects_what_the_kernels_refuse(kwargs, match):
    base = dict(ep_size=4, rank=0, num_local_experts=2, hidden=H, top_k=8, token_capacity=4)
    with pytest.raises(MoeEpUsageError, match=match):
        push_window(**{**base, **kwargs})


@dataclass
class Recorder:
    calls: list[tuple[str, tuple]] = field(default_factory=list)
    fail: str = ""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, args))
            if name == self.fail:
                raise RuntimeError(f"{name} failed")

        return call


def _pipe(a2a: Recorder, gemm: Recorder) -> PushPipe:
    lay = push_window(ep_size=2, rank=0, num_local_experts=E, hidden=H, top_k=2, token_capacity=T)
    dev = torch.device("cpu")
    window = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    combine = window[lay.combine_offset : lay.combine_offset + T * 2 * H * 2]
    return PushPipe(
        layout=lay,
        inter=I,
        a2a=a2a,
        gemm_runner=gemm,
        window=window,
        peer_bases=0x1000,
        scratch=PushScratch.allocate(lay, dev),
        bufs=GemmBuffers.allocate(lay, I, dev),
        workspace=torch.empty(1, dtype=torch.uint8),
        combine=combine.view(torch.bfloat16).view(T, 2, H),
    )


def _weights() -> PushWeights:
    f8 = torch.float8_e4m3fn
    return PushWeights(
        torch.zeros(E, 2 * I, H, dtype=f8),
        torch.ones(E, 2 * I // 128, H // 128),
        torch.zeros(E, H, I, dtype=f8),
        torch.ones(E, H // 128, I // 128),
    )


def test_round_calls_the_protocol_in_order_with_the_layout_scalars():
    a2a, gemm = Recorder(), Recorder()
    pipe = _pipe(a2a, gemm)
    pipe.combine.fill_(1.0)
    calls: list[tuple[str, tuple]] = []
    a2a.calls = gemm.calls = calls  # one shared log keeps the interleaving
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    ids = torch.full((T, 2), -1, dtype=torch.int32)
    w = torch.zeros(T, 2)
    out = torch.empty(3, H, dtype=torch.bfloat16)
    w8 = _weights()
    assert pipe.run_round(x, ids, w, w8, out, 3) is out
    assert [c[0] for c in calls] == ROUND
    assert torch.count_nonzero(pipe.combine) == 0  # inbox cleared before the round
    layout = pipe.layout.launch_args(0x1000)
    by_name = dict(calls)
    for name in ROUND:
        if name.startswith("sm90_push_") and name != "sm90_push_bump_tag":
            args = tuple(a if isinstance(a, int) else None for a in by_name[name])
            starts = [i for i in range(len(args)) if args[i : i + 21] == layout]
            assert starts, f"{name} lacks the 21 layout scalars"
    dispatch = by_name["sm90_push_dispatch_fp8"]
    assert dispatch[0] is x and dispatch[1] is ids and dispatch[2] is w
    reduce = by_name["sm90_combine_reduce"]
    assert reduce[0] is out and reduce[-1] == 3
    fc1, fc2 = (c[1] for c in calls if c[0] == "moe_gemm")
    assert fc1[2] is w8.w13 and fc1[4:6] == (2 * I, H) and fc1[7] is w8.w13_scales
    assert fc2[2] is w8.w2 and fc2[4:6] == (H, I) and fc2[7] is w8.w2_scales


def test_failed_round_publishes_abort_and_poisons_the_pipe():
    a2a, gemm = Recorder(), Recorder(fail="moe_gemm")
    pipe = _pipe(a2a, gemm)
    args = (
        torch.zeros(T, H, dtype=torch.bfloat16),
        torch.full((T, 2), -1, dtype=torch.int32),
        torch.zeros(T, 2),
        _weights(),
        torch.empty(0, H, dtype=torch.bfloat16),
        0,
    )
    with pytest.raises(RuntimeError, match="moe_gemm failed"):
        pipe.run_round(*args)
    assert a2a.calls[-1][0] == "sm90_push_publish_abort"
    with pytest.raises(RuntimeError, match="poisoned"):
        pipe.run_round(*args)


@pytest.fixture
def fakes(monkeypatch):
    built, rounds = [], []

    def fake_compile(self, g):
        built.append(g)
        return f"pipe{len(built)}"

    def fake_launch(self, pipe, s, output):
        rounds.append((pipe, s))
        output.fill_(7.0)

    freed = fake_gpu_pieces(
        monkeypatch,
        push.Sm90Fp8Fp8Bf16PushCudaKernel,
        push._POOL,
        compile=fake_compile,
        launch=fake_launch,
    )
    return built, freed, rounds


def _kernel(config=None, hidden=H):
    return make_kernel(
        push.Sm90Fp8Fp8Bf16PushCudaKernel,
        config or Config(top_k=2),
        num_experts=E,
        intermediate=I,
        hidden=hidden,
        max_tokens=T,
    )


def test_push_kernel_pools_stages_int32_and_frees_on_last_destroy(fakes):
    built, freed, rounds = fakes
    a, b, other = _kernel(), _kernel(), _kernel(hidden=2 * H)
    for k in (a, b, other):
        k.warmup()
    assert len(built) == 2
    ids = torch.tensor([[0, -1], [3, 1], [2, 2]])
    t = MoEEpTensors(
        hidden_states=torch.randn(3, H).to(torch.bfloat16),
        topk_ids=ids,
        topk_weights=torch.rand(3, 2),
    )
    out = torch.zeros(3, H, dtype=torch.bfloat16)
    got = a.compute_staged(staged=a.stage_inputs(tensors=t, output=out))
    assert got is out and float(out[0, 0]) == 7.0
    pipe, s = rounds[0]
    assert pipe == "pipe1" and s.topk_ids.dtype == torch.int32
    assert s.topk_ids.shape == (T, 2) and int(s.topk_ids[3:].max()) == -1
    assert s.num_tokens == 3 and float(s.topk_weights[0, 1]) == 0.0
    a.destroy()
    assert freed == []
    b.destroy()
    assert freed == ["pipe1"]
    other.destroy()
    assert freed == ["pipe1", "pipe2"]


def test_push_kernel_refuses_knobs_the_drop_cannot_honour():
    with pytest.raises(MoeEpUsageError, match="gate_up_clamp"):
        _kernel(config=Config(gate_up_clamp=7.0))
    with pytest.raises(MoeEpUsageError, match="use_ue8m0_scales"):
        _kernel(config=Config(use_ue8m0_scales=True))
    with pytest.raises(MoeEpUsageError, match="one of"):
        Config().check_problem(
            hidden_size=H,
            intermediate_size=I,
            top_k=3,
            num_experts=E,
            world_size=1,
            max_tokens_per_rank=T,
        )

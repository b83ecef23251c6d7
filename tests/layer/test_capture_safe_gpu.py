"""Capture and replay of the capture-safe bf16 forward on a GPU (skipped elsewhere).

Never run: written on a machine without a GPU (the CPU tests in test_capture_safe.py show
the same forward makes no host synchronisation). The kernel's stage + compute is captured
once at max_tokens_per_rank with the live count a device tensor, then replayed with fewer
live tokens; each replay must equal an eager forward of the live rows and leave the rows
past the count as they were. The kernel alone is captured here; test_layer_capture_gpu.py
captures `MoEEpLayer.forward` (docs/runtime.md, "Graph capture"). One rank: the
all-to-all under capture (NCCL) is not exercised.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from layer_cases import Case, make_problem

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable.configs import Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig
from moe_ep.spawn import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_T, H, K, E = 8, 256, 4, 8
SENTINEL = 7.0


@pytest.fixture(scope="module")
def layer() -> Iterator[MoEEpLayer]:
    p = make_problem(Case("capture_safe_gpu", experts=E, seed=3), 1)
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    built = MoEEpLayer(
        boot,
        FleetParams(E, MAX_T, H),
        MoEWeightPack(p["w13"], p["w2"]),
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(capture_safe=True),
    )
    assert built.device.type == "cuda" and built._kernel.capturable
    yield built
    built.destroy()


def test_capture_at_max_tokens_and_replay_with_fewer_live(layer: MoEEpLayer) -> None:
    dev = layer.device
    g = torch.Generator().manual_seed(4)
    x = torch.randn(MAX_T, H, generator=g).bfloat16().to(dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(MAX_T)]).to(dev)
    w = torch.rand(MAX_T, K, generator=g).to(dev)
    live = torch.full((1,), MAX_T, dtype=torch.int32, device=dev)
    out = torch.empty((MAX_T, H), dtype=torch.bfloat16, device=dev)
    kernel = layer._kernel
    tensors = MoEEpTensors(x, ids, w, num_valid_tokens_tensor=live)

    def forward() -> None:
        kernel.compute_staged(staged=kernel.stage_inputs(tensors=tensors, output=out))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # warmed: the workspaces exist before the capture
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for c in range(MAX_T + 1):
        live.fill_(c)
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        want = layer.forward(MoEEpTensors(x[:c], ids[:c], w[:c]))
        assert torch.equal(out[:c], want), c
        assert bool((out[c:] == SENTINEL).all()), c

"""Capture and replay of `MoEEpLayer.forward` (capture_safe=True) on a GPU (skipped elsewhere).

NEVER RUN: written on a machine without a GPU; the CPU tests in test_layer_capture.py show,
with the capture simulated, that the same layer forward reads no device value on the host.
The host's recipe (docs/runtime.md, "Graph capture"): eager warm-up forwards with the
shapes the capture will use (the workspaces exist before it), one capture at
max_tokens_per_rank with the live count a device tensor, then replays after writing the
count (and the inputs) in place. Each replay must equal an eager forward of the same rows
bit for bit, leave the caller's rows past the count as they were, and add the live pairs to
`expert_load`. One rank: the NCCL all-to-all under capture is not exercised.
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
    p = make_problem(Case("layer_capture_gpu", experts=E, seed=5), 1)
    built = MoEEpLayer(
        BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}"),
        FleetParams(E, MAX_T, H),
        MoEWeightPack(p["w13"], p["w2"]),
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(capture_safe=True),
        count_load=True,
    )
    assert built.device.type == "cuda" and built._kernel.capturable
    yield built
    built.destroy()


def test_capture_the_layer_at_max_tokens_and_replay_with_live_counts(layer: MoEEpLayer) -> None:
    dev = layer.device
    g = torch.Generator().manual_seed(4)
    x = torch.randn(MAX_T, H, generator=g).bfloat16().to(dev)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(MAX_T)])
    ids[1, 2] = -1
    ids = ids.to(dev)
    w = torch.rand(MAX_T, K, generator=g).to(dev)
    live = torch.full((1,), MAX_T, dtype=torch.int32, device=dev)
    out = torch.empty((MAX_T, H), dtype=torch.bfloat16, device=dev)
    tensors = MoEEpTensors(x, ids, w, output=out, num_valid_tokens_tensor=live)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # eager warm-up, the capture's shapes
            layer.forward(tensors)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.forward(tensors)
    for c in (MAX_T, 0, 3, 1, MAX_T - 1, 5):
        live.fill_(c)
        out.fill_(SENTINEL)
        layer.reset_expert_load()
        graph.replay()
        torch.cuda.synchronize()
        load = layer.expert_load.clone()
        want = layer.forward(MoEEpTensors(x[:c], ids[:c], w[:c]))
        assert torch.equal(out[:c], want), c
        assert bool((out[c:] == SENTINEL).all()), c
        live_ids = ids[:c]
        assert torch.equal(load, torch.bincount(live_ids[live_ids >= 0], minlength=E)), c

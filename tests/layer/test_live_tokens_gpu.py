"""The live-token count and CUDA-graph capture on a GPU (skipped elsewhere, with the reason).

Never run: written without a GPU. The portable path honours `num_valid_tokens_tensor` on
CUDA as on CPU (read on the host while staging), and it is not capturable (its all-to-all
needs the split sizes on the host): a forward under capture is refused with a clear error
instead of failing inside CUDA (docs/runtime.md, "Graph capture").
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from layer_cases import KERNELS, Case, make_problem

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.errors import MoeEpUsageError
from moe_ep.spawn import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MAX_T, H, K = 8, 256, 4


@pytest.fixture(scope="module")
def layer() -> Iterator[MoEEpLayer]:
    p = make_problem(Case("live_gpu", experts=8, seed=3), 1)
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    built = MoEEpLayer(
        boot, FleetParams(8, MAX_T, H), MoEWeightPack(p["w13"], p["w2"]), KERNELS["bf16"]
    )
    assert built.device.type == "cuda"
    yield built
    built.destroy()


def _inputs(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(MAX_T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(MAX_T)])
    return x.to(dev), ids.to(dev), torch.rand(MAX_T, K, generator=g).to(dev)


def test_live_count_on_cuda_matches_a_forward_of_the_live_rows(layer: MoEEpLayer) -> None:
    x, ids, w = _inputs(layer.device)
    live = torch.empty(1, dtype=torch.int32, device=layer.device)
    for c in range(MAX_T + 1):
        live.fill_(c)
        out = torch.full((MAX_T, H), 7.0, dtype=torch.bfloat16, device=layer.device)
        y = layer.forward(MoEEpTensors(x, ids, w, output=out, num_valid_tokens_tensor=live))
        assert torch.equal(y[:c], layer.forward(MoEEpTensors(x[:c], ids[:c], w[:c])))
        assert bool((y[c:] == 7.0).all())


def test_a_captured_forward_of_a_portable_kernel_is_refused(layer: MoEEpLayer) -> None:
    x, ids, w = _inputs(layer.device)
    live = torch.full((1,), MAX_T, dtype=torch.int32, device=layer.device)
    tensors = MoEEpTensors(x, ids, w, num_valid_tokens_tensor=live)
    layer.forward(tensors)  # warmed
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(MoeEpUsageError, match=r"cannot be captured in a CUDA graph"),
        torch.cuda.graph(graph),
    ):
        layer.forward(tensors)

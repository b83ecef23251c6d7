"""`MoEEpLayer.forward_unfinalized`: each (token, slot)'s expert row, the weight the host
still applies and the route map (flashinfer 0.7.4's layout); reduced on the host in fp32,
slots in increasing order, rounded once to bf16, it equals `forward` bit for bit, on every
portable format at EP 1 and 2, with `apply_routing_weights_before_fc2` both ways."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch
from layer_cases import KERNELS, Case, from_wire, rank_share, to_wire, token_split

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable.kernel import Bf16TorchKernel
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import FORMATS
from moe_ep.spawn import free_port, spawn_local

CASE = Case("unfinalized", tokens=10, pad_frac=0.25, seed=5)
"""A quarter of the slots padded (-1), and token 2 with none at all."""


def host_reduce(rows: torch.Tensor, weights: torch.Tensor, route_map: torch.Tensor) -> torch.Tensor:
    """What a host does with the unfinalized result: `bf16(sum_j w[:, j] * rows[map[:, j]])`,
    fp32, slots in increasing order."""
    n, k = weights.shape
    terms = rows[route_map.long().reshape(-1)].float().view(n, k, -1) * weights[:, :, None]
    acc = terms[:, 0].clone()
    for j in range(1, k):
        acc = acc + terms[:, j]
    return acc.bfloat16()


def unfinalized_worker(rank: int, world_size: int, jobs: list[tuple[str, bool]]) -> dict[str, Any]:
    """Per (format, before_fc2): forward and forward_unfinalized on the same inputs."""
    from moe_ep.registry import get_kernel

    torch.set_num_threads(1)
    p, es, sl = rank_share(CASE, world_size, rank)
    out: dict[str, Any] = {}
    for fmt, before in jobs:
        config = get_kernel(KERNELS[fmt]).config_cls(apply_routing_weights_before_fc2=before)
        layer = MoEEpLayer(
            BootstrapConfig(world_size, rank, timeout_s=60.0),
            FleetParams(CASE.num_experts(world_size), max(token_split(CASE, world_size)), 256),
            MoEWeightPack(p["w13"][es], p["w2"][es]),
            config,
        )
        try:
            t = MoEEpTensors(p["x"][sl], p["ids"][sl], p["topk_weights"][sl])
            y = layer.forward(t)
            rows, w, rmap = layer.forward_unfinalized(t)
        finally:
            layer.destroy()
        out[f"{fmt}/{before}"] = {
            "y": to_wire(y),
            "rows": to_wire(rows),
            "weights": w.numpy().copy(),
            "route_map": rmap.numpy().copy(),
            "dtypes": (str(rows.dtype), str(w.dtype), str(rmap.dtype)),
        }
    return out


@cache
def _run(world_size: int) -> list[dict[str, Any]]:
    jobs = [(fmt, before) for fmt in FORMATS for before in (False, True)]
    return spawn_local(unfinalized_worker, world_size, jobs, timeout_s=600)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", (1, 2))
@pytest.mark.parametrize("before_fc2", (False, True))
@pytest.mark.parametrize("fmt", FORMATS)
def test_host_reduce_of_unfinalized_equals_forward(
    world_size: int, fmt: str, before_fc2: bool
) -> None:
    p = rank_share(CASE, world_size, 0)[0]
    split = token_split(CASE, world_size)
    for rank, res in enumerate(_run(world_size)):
        r = res[f"{fmt}/{before_fc2}"]
        lo = sum(split[:rank])
        ids = p["ids"][lo : lo + split[rank]]
        n, k = ids.shape
        rows, y = from_wire(r["rows"]).view(n * k, -1), from_wire(r["y"]).view(n, -1)
        w, rmap = torch.from_numpy(r["weights"]), torch.from_numpy(r["route_map"])
        assert r["dtypes"] == ("torch.bfloat16", "torch.float32", "torch.int32")
        assert tuple(w.shape) == tuple(rmap.shape) == (n, k)
        assert torch.equal(rmap, torch.arange(n * k, dtype=torch.int32).view(n, k))
        pad = ids < 0
        assert bool(pad.any()) and bool((~pad).any())
        # the weight the host still applies: the router's, or one when applied before FC2
        want_w = torch.ones(n, k) if before_fc2 else p["topk_weights"][lo : lo + split[rank]]
        assert torch.equal(w, torch.where(pad, 0.0, want_w))
        assert not bool(rows.view(n, k, -1)[pad].any())  # a padded slot's row is zeros
        assert bool(rows.view(n, k, -1)[~pad].any())
        assert torch.equal(host_reduce(rows, w, rmap), y), f"EP{world_size} rank {rank}"


def _layer() -> MoEEpLayer:
    g = torch.Generator().manual_seed(0)
    weights = MoEWeightPack(
        (torch.randn(4, 256, 128, generator=g) / 11).bfloat16(),
        (torch.randn(4, 128, 128, generator=g) / 11).bfloat16(),
    )
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    return MoEEpLayer(boot, FleetParams(4, 8, 128), weights, "any_bf16_bf16_bf16_torch")


def _inputs(**extra: Any) -> MoEEpTensors:
    ids = torch.tensor([[0, 1], [2, 3], [1, -1]])
    return MoEEpTensors(torch.randn(3, 128).bfloat16(), ids, torch.rand(3, 2), **extra)


def test_output_buffer_and_kernels_without_it_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = _layer()
    try:
        with pytest.raises(MoeEpUsageError, match=r"output must be None for forward_unfinalized"):
            layer.forward_unfinalized(_inputs(output=torch.empty(3, 128, dtype=torch.bfloat16)))
        monkeypatch.setattr(Bf16TorchKernel, "supports_unfinalized", False)
        with pytest.raises(
            MoeEpUsageError, match=r"'any_bf16_bf16_bf16_torch' has no unfinalized forward"
        ):
            layer.forward_unfinalized(_inputs())
    finally:
        layer.destroy()


def test_gpu_kernels_declare_no_unfinalized_forward() -> None:
    from moe_ep.backends.portable.kernel import PortableTorchKernel
    from moe_ep.registry import available_kernels, get_kernel

    names = [info.name for info in available_kernels()]
    assert any(n.startswith("sm") for n in names)  # the GPU wrappers are listed too
    for name in names:
        cls = get_kernel(name)
        assert cls.supports_unfinalized == issubclass(cls, PortableTorchKernel), name

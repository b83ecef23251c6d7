"""A host written against flashinfer-python 0.7.4's `flashinfer.moe_ep` mega layer runs on
moe-ep with only its import changed: at EP1 and EP2 on the portable bf16 kernel its output is
bit-identical to moe-ep's native construction; the layer arguments flashinfer has and
moe-ep cannot honour are refused before any collective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from moe_ep.errors import MoeEpUsageError
from moe_ep.spawn import spawn_local

E, T, H, I, K = 4, 6, 64, 32, 2  # noqa: E741 - I is the glossary name
KERNEL = "any_bf16_bf16_bf16_torch"


@dataclass
class MegaConfig:
    """The four fields of flashinfer 0.7.4's `flashinfer.moe_ep.MegaConfig` (written here: a
    host passes flashinfer's own class; moe-ep reads its fields, not its type)."""

    megakernel: object
    quantize_input: bool = True
    preprocess_weights: bool = True
    transformed_weights: object | None = None


def _problem(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w13 = torch.randn(E, 2 * I, H, generator=g).bfloat16() * 0.1
    w2 = torch.randn(E, H, I, generator=g).bfloat16() * 0.1
    g.manual_seed(100 + rank)
    e_local = E // world_size
    return {
        "w13": w13[rank * e_local : (rank + 1) * e_local].clone(),
        "w2": w2[rank * e_local : (rank + 1) * e_local].clone(),
        "x": torch.randn(T, H, generator=g).bfloat16(),
        "ids": torch.randint(0, E, (T, K), generator=g, dtype=torch.int32),
        "w": torch.rand(T, K, generator=g),
    }


def _flashinfer_style(rank: int, world_size: int, p: dict[str, torch.Tensor]) -> torch.Tensor:
    # As a flashinfer.moe_ep host writes it; only this import line changed.
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack

    bootstrap = BootstrapConfig(world_size, rank, 0, True, None, None, None, device=None)
    fleet = FleetParams(E, T, H, 2, tuning_live_tokens=None)
    weights = MoEWeightPack(p["w13"], p["w2"], None, None)
    layer = MoEEpLayer(bootstrap, fleet, weights, (), backend=MegaConfig(megakernel=KERNEL))
    try:
        t = MoEEpTensors(p["x"], p["ids"], p["w"], None, None, None, None, None, None, None)
        return layer.forward(t)
    finally:
        layer.destroy()


def _native(rank: int, world_size: int, p: dict[str, torch.Tensor]) -> torch.Tensor:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack

    with MoEEpLayer(
        BootstrapConfig(world_size, rank),
        FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H),
        MoEWeightPack(w13=p["w13"], w2=p["w2"]),
        KERNEL,
    ) as layer:
        return layer(MoEEpTensors(hidden_states=p["x"], topk_ids=p["ids"], topk_weights=p["w"]))


def _host_worker(rank: int, world_size: int) -> dict[str, list[list[int]]]:
    torch.set_num_threads(1)
    p = _problem(rank, world_size)
    fi, native = _flashinfer_style(rank, world_size, p), _native(rank, world_size, p)
    # the bits, picklable (a tensor's shared storage would not outlive the rank)
    return {k: t.view(torch.int16).tolist() for k, t in (("flashinfer", fi), ("native", native))}


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", (1, 2))
def test_a_flashinfer_host_gets_the_native_bits(world_size: int) -> None:
    results = spawn_local(_host_worker, world_size, timeout_s=120)
    for rank, r in enumerate(results):
        got, want = (torch.tensor(r[k], dtype=torch.int16) for k in ("flashinfer", "native"))
        assert got.shape == (T, H) and got.view(torch.bfloat16).abs().sum() > 0
        assert torch.equal(got, want), f"EP{world_size} rank {rank}"


def _layer_args() -> tuple[Any, ...]:
    from moe_ep import BootstrapConfig, FleetParams, MoEWeightPack

    p = _problem(0, 1)
    return BootstrapConfig(1, 0), FleetParams(E, T, H), MoEWeightPack(p["w13"], p["w2"])


@pytest.mark.parametrize(
    ("tail", "kwargs", "message"),
    [
        (((object(),),), {"backend": KERNEL}, r"fleet_knobs must be empty, got \(<object"),
        ((), {"fleet_knobs": [1], "backend": KERNEL}, r"fleet_knobs must be empty, got \[1\]"),
        ((KERNEL,), {"backend": KERNEL}, r"got the backend twice"),
        ((), {}, r"MoEEpLayer needs backend="),
        ((), {"backend": MegaConfig(KERNEL, quantize_input=False)},
         r"MegaConfig\.quantize_input=False is not supported"),
        ((), {"backend": MegaConfig(KERNEL, preprocess_weights=False)},
         r"MegaConfig\.preprocess_weights=False is not supported"),
        ((), {"backend": MegaConfig(KERNEL, transformed_weights=object())},
         r"MegaConfig\.transformed_weights must be None"),
    ],
)  # fmt: skip
def test_layer_arguments_moe_ep_cannot_honour_are_refused(
    tail: tuple[Any, ...], kwargs: dict[str, Any], message: str
) -> None:
    from moe_ep import MoEEpLayer

    with pytest.raises(MoeEpUsageError, match=message):
        MoEEpLayer(*_layer_args(), *tail, **kwargs)


def test_moe_ep_order_and_a_mega_config_build_the_same_layer() -> None:
    from moe_ep import MoEEpLayer

    for tail, kwargs in (((KERNEL,), {}), ((), {"backend": MegaConfig(KERNEL)})):
        with MoEEpLayer(*_layer_args(), *tail, **kwargs) as layer:
            assert layer.kernel_name == KERNEL

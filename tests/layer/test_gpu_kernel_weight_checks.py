"""The GPU kernels' weight checks through `MoEEpLayer`, on CPU: each runs once per
construction, and a knob that only describes pre-quantized packs is refused otherwise.

The runtime (`acquire`), the cross-rank agreement and `availability` are faked; the kernels'
own construction (checks, weight preparation on CPU) runs for real. Nothing here launches.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import moe_ep.layer.layer as layer_module
import moe_ep.runtime
from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEWeightPack
from moe_ep.errors import MoeEpUsageError

pytest.importorskip("moe_ep_sm90")
pytest.importorskip("moe_ep_sm100")

E, H, I = 2, 512, 512  # noqa: E741 - the glossary names; 512: DeepGEMM's multiple


@dataclass
class _Runtime:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: Any = None
    failure: Any = None  # a healthy runtime (moe_ep.runtime.Runtime.failure)

    def barrier(self) -> None:
        pass

    def report_failure(self, reason: str) -> None:
        pass

    def release(self) -> None:
        pass


# kernel -> (the module whose functions its validation calls, those functions)
CHECKERS = {
    "sm90_fp8_fp8_bf16_pull_cutedsl": (
        "moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.kernel",
        ("check_pack",),
    ),
    "sm90_fp8_fp8_bf16_push_cuda": (
        "moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.kernel",
        ("check_pack", "check_launchable"),
    ),
    "sm100_nvfp4_nvfp4_bf16_cutedsl": ("moe_ep_sm100.common.cutedsl", ("check_sm100_pack",)),
    "sm100_mxfp8_mxfp8_bf16_cutedsl": ("moe_ep_sm100.common.cutedsl", ("check_sm100_pack",)),
    "sm100_mxfp8_mxfp4_bf16_cutedsl": ("moe_ep_sm100.common.cutedsl", ("check_sm100_pack",)),
    "sm100_fp8_fp4_bf16_deepgemm": (
        "moe_ep_sm100.kernels.sm100_fp8_fp4_bf16_deepgemm.kernel",
        ("_checked_intermediate",),
    ),
}


def _kernel_class(name: str) -> Any:
    from moe_ep.registry import get_kernel

    return get_kernel(name)


def _weights() -> MoEWeightPack:
    g = torch.Generator().manual_seed(0)
    return MoEWeightPack(
        torch.randn(E, 2 * I, H, generator=g).bfloat16(),
        torch.randn(E, H, I, generator=g).bfloat16(),
    )


def _fake_runtime(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    monkeypatch.setattr(cls, "availability", classmethod(lambda c: (True, "")))
    monkeypatch.setattr(moe_ep.runtime, "acquire", lambda config, requirements=None: _Runtime())
    monkeypatch.setattr(layer_module, "agree_on_setup", lambda runtime, fingerprint: None)


def _count(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[object]:
    calls: list[object] = []
    real: Callable[..., Any] = getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("name", sorted(CHECKERS))
def test_layer_runs_each_weight_check_once(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Before: the layer ran the kernel's checks, then the kernel's construction ran them
    (or some of them) again."""
    cls = _kernel_class(name)
    module_name, checkers = CHECKERS[name]
    module = importlib.import_module(module_name)
    _fake_runtime(monkeypatch, cls)
    counts = {checker: _count(monkeypatch, module, checker) for checker in checkers}
    layer = MoEEpLayer(
        BootstrapConfig(1, 0), FleetParams(E, 8, H), _weights(), cls.config_cls(top_k=2)
    )
    try:
        assert {k: len(v) for k, v in counts.items()} == dict.fromkeys(checkers, 1)
    finally:
        layer.destroy()


def test_pull_refuses_a_pack_grouping_for_unquantized_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`prequantized_fc1_gate_up_interleave` describes a pre-quantized pack; with bf16
    weights it would be ignored, so it is refused (before any collective)."""
    from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig as Config

    cls = _kernel_class("sm90_fp8_fp8_bf16_pull_cutedsl")
    monkeypatch.setattr(cls, "availability", classmethod(lambda c: (True, "")))
    config = Config(prequantized_fc1_gate_up_interleave=8)
    # world size 2 and no rendezvous: the error must come before any collective
    with pytest.raises(
        MoeEpUsageError,
        match=r"prequantized_fc1_gate_up_interleave=8 describes a pre-quantized pack, but the "
        r"weights are torch.bfloat16 without scales",
    ):
        MoEEpLayer(BootstrapConfig(2, 1), FleetParams(2 * E, 8, H), _weights(), config)

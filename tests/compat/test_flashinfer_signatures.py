"""The five classes moe-ep shares with flashinfer-python 0.7.4's `flashinfer.moe_ep` take its
constructor arguments: the same names, positions and keyword-only parameters (read from the
wheel's source with `ast`: `flashinfer_wheel`), moe-ep's own names beside them, and each
flashinfer field moe-ep cannot honour refused by name."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest
import torch
from flashinfer_wheel import Param, flashinfer_signatures, wheel_path

import moe_ep
from moe_ep.errors import MoeEpUsageError

# Where moe-ep's default differs from flashinfer's, and why (docs/runtime.md has the table):
DIFFERENT_DEFAULTS = {
    # required there; here None so that moe-ep's keyword hidden_size= can give it instead
    ("FleetParams", "token_hidden_size"): "None",
    # split-transport enums there (ignored by its mega path); here only None is accepted
    ("FleetParams", "algorithm"): "None",
    ("FleetParams", "layout"): "None",
    # None there, then a TypeError; here plainly required
    ("MoEWeightPack", "w13"): None,
    ("MoEWeightPack", "w2"): None,
    # 'nccl_ep' (its split transport) there; here required (no default kernel)
    ("MoEEpLayer", "backend"): "None",
}
REFUSED_TENSOR_FIELDS = (
    "scales", "fc1_alpha", "fc2_alpha", "fc1_norm_const", "fc1_activation_per_token_scale",
    "recv_count", "num_tokens_per_expert", "runtime_max_tokens_per_rank",
)  # fmt: skip
"""flashinfer's `MoEEpTensors` fields moe-ep refuses unless None (pre-quantized activations,
per-call alphas / scales, counters its backends fill in, the split path's token bound)."""
EXTRA_POSITIONAL = {"MoEWeightPack": ("w13_global_scale", "w2_global_scale")}
"""moe-ep's own positional parameters after all of flashinfer's (nvfp4's global scales)."""


def ours(name: str) -> list[Param]:
    obj = getattr(moe_ep, name)
    sig = inspect.signature(obj.__init__ if name == "MoEEpLayer" else obj)
    out = []
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY), (name, p)
        default = None if p.default is p.empty else repr(p.default)
        out.append(Param(p.name, p.kind is p.KEYWORD_ONLY, default))
    return out


@pytest.fixture(scope="module")
def theirs() -> dict[str, list[Param]]:
    return flashinfer_signatures(wheel_path())


@pytest.mark.parametrize("name", ["BootstrapConfig", "FleetParams", "MoEEpTensors",
                                  "MoEWeightPack", "MoEEpLayer"])  # fmt: skip
def test_flashinfer_parameters_bind_the_same(theirs: dict[str, list[Param]], name: str) -> None:
    mine, want = ours(name), theirs[name]
    their_positional = [p for p in want if not p.kw_only]
    my_positional = [p for p in mine if not p.kw_only]
    # positions: theirs first, in their order; ours may only follow
    assert [p.name for p in my_positional[: len(their_positional)]] == [
        p.name for p in their_positional
    ]
    extra = tuple(p.name for p in my_positional[len(their_positional) :])
    assert extra == EXTRA_POSITIONAL.get(name, ()), f"{name}: positional extras {extra}"
    by_name = {p.name: p for p in mine}
    for p in want:
        assert p.name in by_name, f"{name}.{p.name} missing"
        got = by_name[p.name]
        assert got.kw_only == p.kw_only, f"{name}.{p.name}: keyword-only {got.kw_only}"
        expected = DIFFERENT_DEFAULTS.get((name, p.name), p.default)
        assert got.default == expected, f"{name}.{p.name}: default {got.default} != {expected}"


def test_the_documented_differences_are_real(theirs: dict[str, list[Param]]) -> None:
    """Each entry of DIFFERENT_DEFAULTS does differ in the wheel (none is stale)."""
    for (name, field), mine in DIFFERENT_DEFAULTS.items():
        (p,) = (p for p in theirs[name] if p.name == field)
        assert p.default != mine, (name, field, p.default)


# -- flashinfer's spellings, honoured ---------------------------------------------------
def test_fleet_params_takes_both_hidden_size_names() -> None:
    a = moe_ep.FleetParams(8, 16, 64)
    b = moe_ep.FleetParams(num_experts=8, max_tokens_per_rank=16, token_hidden_size=64)
    c = moe_ep.FleetParams(num_experts=8, max_tokens_per_rank=16, hidden_size=64)
    d = moe_ep.FleetParams(8, 16, token_hidden_size=64, hidden_size=64, dtype_bytes=2)
    assert a == b == c == d and repr(a) == repr(c)
    assert (a.token_hidden_size, a.hidden_size) == (64, 64)
    assert dataclasses.replace(c, max_tokens_per_rank=4).hidden_size == 64
    with pytest.raises(MoeEpUsageError, match=r"token_hidden_size=64 and hidden_size=32 name"):
        moe_ep.FleetParams(8, 16, 64, hidden_size=32)
    with pytest.raises(MoeEpUsageError, match=r"token_hidden_size must be an int >= 1, got None"):
        moe_ep.FleetParams(8, 16)


def test_bootstrap_config_takes_flashinfer_positions() -> None:
    group = object()
    cfg = moe_ep.BootstrapConfig(2, 1, 0, False, None, group, None, device=3)
    assert (cfg.process_group, cfg.nccl_comm, cfg.tcp_store, cfg.device) == (group, None, None, 3)


def test_weight_pack_takes_flashinfer_positions() -> None:
    w13, w2, s13, s2 = (torch.zeros(1, 4, 4) for _ in range(4))
    pack = moe_ep.MoEWeightPack(w13, w2, s13, s2)
    assert pack.w13_scale is s13 and pack.w2_scale is s2 and pack.prequantized


# -- flashinfer fields moe-ep cannot honour, refused by name ----------------------------
def _non_none(field: str) -> object:
    return 1 if field == "runtime_max_tokens_per_rank" else torch.ones(2)


def _tensors(**extra: Any) -> moe_ep.MoEEpTensors:
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    return moe_ep.MoEEpTensors(x, ids, torch.ones(2, 1), **extra)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: moe_ep.BootstrapConfig(2, 0, nccl_comm=1234),
         r"BootstrapConfig\.nccl_comm must be None: moe-ep cannot adopt a raw ncclComm_t "
         r"\(got 1234\)"),
        # moe-ep's order before: the group as the fifth positional
        (lambda: moe_ep.BootstrapConfig(2, 0, 0, True, object()),
         r"nccl_comm must be None.*a process group given as the fifth positional argument .* "
         r"goes in process_group=, by keyword"),
        (lambda: moe_ep.BootstrapConfig(2, 0, tcp_store=object()),
         r"BootstrapConfig\.tcp_store must be None"),
        (lambda: moe_ep.FleetParams(8, 16, 64, 1), r"FleetParams\.dtype_bytes must be 2, got 1"),
        (lambda: moe_ep.FleetParams(8, 16, 64, algorithm="HIGH_THROUGHPUT"),
         r"FleetParams\.algorithm must be None, got 'HIGH_THROUGHPUT': a flashinfer "
         r"split-transport field"),
        (lambda: moe_ep.FleetParams(8, 16, 64, layout="RANK_MAJOR"),
         r"FleetParams\.layout must be None, got 'RANK_MAJOR'"),
        (lambda: moe_ep.FleetParams(8, 16, 64, tuning_live_tokens=4),
         r"FleetParams\.tuning_live_tokens must be None, got 4"),
        *[
            (lambda f=f: _tensors(**{f: _non_none(f)}), rf"MoEEpTensors\.{f} must be None")
            for f in REFUSED_TENSOR_FIELDS
        ],
    ],
)  # fmt: skip
def test_a_field_moe_ep_cannot_honour_is_refused(build: Any, message: str) -> None:
    with pytest.raises(MoeEpUsageError, match=message):
        build()


def test_every_flashinfer_tensors_field_is_honoured_or_refused(
    theirs: dict[str, list[Param]],
) -> None:
    honoured = {"hidden_states", "topk_ids", "topk_weights", "output"}
    fields = {p.name for p in theirs["MoEEpTensors"]}
    assert fields - honoured == set(REFUSED_TENSOR_FIELDS)
    assert set(moe_ep.MoEEpTensors.UNSUPPORTED_FIELDS) == set(REFUSED_TENSOR_FIELDS)

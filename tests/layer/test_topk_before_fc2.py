"""`apply_routing_weights_before_fc2` (flashinfer 0.7.4's name; `topk_weight_before_fc2` its
deprecated alias): the portable kernels in the sm100 kernels' / DeepGEMM's order
(weight the SwiGLU output, then quantize the FC2 input, then sum unweighted) at EP 1 and 2,
against the oracle with the same option; the SwiGLU step against the direct formula."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest
import torch
import torch.nn.functional as F
from layer_cases import Case, from_wire, make_problem

from moe_ep.backends.portable import comm, experts
from moe_ep.backends.portable.configs import (
    Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig,
    Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig,
    Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig,
)
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.spawn import spawn_local

FORMATS = ("nvfp4", "mxfp8", "fp8_fp4")
PLAIN = Case("plain", seed=11)
CONFIGS = (  # the base's __post_init__ alone, and the two subclasses that extend it
    Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig,
    Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig,
    Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig,
)
KNOB = Case("before_fc2", seed=11, config=(("apply_routing_weights_before_fc2", True),))


@cache
def _run(world_size: int) -> dict[str, torch.Tensor]:
    from layer_cases import cases_worker

    jobs = [(case, fmt) for fmt in FORMATS for case in (PLAIN, KNOB)]
    results = spawn_local(cases_worker, world_size, jobs, False, timeout_s=240)
    return {
        key: torch.cat([from_wire(r["out"][key]) for r in results]) for key in results[0]["out"]
    }


def _oracle(world_size: int, fmt: str, before_fc2: bool):
    p = make_problem(KNOB, world_size)
    return oracle_forward(
        p["x"], p["ids"], p["topk_weights"], p["w13"], p["w2"], fmt=fmt,
        apply_routing_weights_before_fc2=before_fc2,
    )  # fmt: skip


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", (1, 2))
@pytest.mark.parametrize("fmt", FORMATS)
def test_before_fc2_matches_the_oracle_with_the_same_option(world_size: int, fmt: str) -> None:
    got = _run(world_size)
    knob, plain = got[f"{KNOB.name}/{fmt}"], got[f"{PLAIN.name}/{fmt}"]
    with_knob, without = _oracle(world_size, fmt, True), _oracle(world_size, fmt, False)
    report = compare_to_oracle(knob, with_knob)
    assert report.ok, f"EP{world_size} {fmt}: {report}"
    assert compare_to_oracle(plain, without).ok
    # the option changes the rounding, hence the bits, not the value
    assert not torch.equal(knob, plain)
    assert not torch.equal(with_knob.exact, without.exact)


def test_swiglu_row_scale_is_applied_before_requantize() -> None:
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(5, 16, generator=g).bfloat16()
    scale = torch.rand(5, generator=g)
    seen: list[torch.Tensor] = []

    def requantize(t: torch.Tensor, out: torch.Tensor) -> None:
        seen.append(t.clone())
        out.copy_(t)

    h = torch.empty(5, 8, dtype=torch.bfloat16)
    experts._swiglu(gu, h, None, None, requantize, comm.Workspace(), scale)
    part = gu.float()  # the kernel's layout: silu over rows of I inside [b, 2I] rows
    want = F.silu(part[:, :8]) * part[:, 8:] * scale[:, None]
    assert torch.equal(torch.cat(seen), want)
    assert torch.equal(h, want.bfloat16())


def test_option_must_be_a_bool() -> None:
    with pytest.raises(
        MoeEpUsageError, match="apply_routing_weights_before_fc2 must be a bool, got 1"
    ):
        Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig(apply_routing_weights_before_fc2=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("config_cls", CONFIGS)
@pytest.mark.parametrize("value", (False, True))
def test_flashinfer_name_is_canonical_and_the_old_name_warns(config_cls: type, value: bool) -> None:
    new = config_cls(apply_routing_weights_before_fc2=value)
    assert new.apply_routing_weights_before_fc2 is value
    with pytest.warns(DeprecationWarning, match=r"topk_weight_before_fc2 is deprecated; use .*"
                      r"apply_routing_weights_before_fc2") as seen:  # fmt: skip
        old = config_cls(topk_weight_before_fc2=value)
    assert seen[0].filename == __file__  # the warning names the caller's line
    assert old == new and repr(old) == repr(new)  # ranks agree whichever name they used
    assert config_cls().apply_routing_weights_before_fc2 is False
    with pytest.warns(DeprecationWarning):
        both = config_cls(apply_routing_weights_before_fc2=value, topk_weight_before_fc2=value)
    assert both == new
    with pytest.warns(DeprecationWarning), pytest.raises(MoeEpUsageError, match=(
        rf"apply_routing_weights_before_fc2={value} and topk_weight_before_fc2={not value} "
        "name the same option with different values")):  # fmt: skip
        config_cls(apply_routing_weights_before_fc2=value, topk_weight_before_fc2=not value)
    assert dataclasses.replace(new, dedup=False).apply_routing_weights_before_fc2 is value


def test_the_oracle_takes_both_names() -> None:
    p = make_problem(KNOB, 1)
    args = (p["x"], p["ids"], p["topk_weights"], p["w13"], p["w2"])
    new = oracle_forward(*args, fmt="mxfp8", apply_routing_weights_before_fc2=True)
    with pytest.warns(DeprecationWarning, match="oracle_forward.topk_weight_before_fc2"):
        old = oracle_forward(*args, fmt="mxfp8", topk_weight_before_fc2=True)
    plain = oracle_forward(*args, fmt="mxfp8")
    assert torch.equal(old.exact, new.exact) and not torch.equal(new.exact, plain.exact)
    with pytest.warns(DeprecationWarning), pytest.raises(MoeEpUsageError, match="different"):
        oracle_forward(
            *args, fmt="mxfp8", apply_routing_weights_before_fc2=True, topk_weight_before_fc2=False
        )

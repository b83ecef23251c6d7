"""`topk_weight_before_fc2`: the portable kernels in the sm100 kernels' / DeepGEMM's order
(weight the SwiGLU output, then quantize the FC2 input, then sum unweighted) at EP 1 and 2,
against the oracle with the same option; the SwiGLU step against the direct formula."""

from __future__ import annotations

from functools import cache

import pytest
import torch
import torch.nn.functional as F
from layer_cases import Case, from_wire, make_problem

from moe_ep.backends.portable import comm, experts
from moe_ep.backends.portable.configs import Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.spawn import spawn_local

FORMATS = ("nvfp4", "mxfp8", "fp8_fp4")
PLAIN = Case("plain", seed=11)
KNOB = Case("before_fc2", seed=11, config=(("topk_weight_before_fc2", True),))


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
        topk_weight_before_fc2=before_fc2,
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

    def requantize(t: torch.Tensor) -> torch.Tensor:
        seen.append(t.clone())
        return t

    h = torch.empty(5, 8, dtype=torch.bfloat16)
    experts._swiglu(gu, h, None, None, requantize, comm.Workspace(), scale)
    part = gu.float()  # the kernel's layout: silu over rows of I inside [b, 2I] rows
    want = F.silu(part[:, :8]) * part[:, 8:] * scale[:, None]
    assert torch.equal(torch.cat(seen), want)
    assert torch.equal(h, want.bfloat16())


def test_option_must_be_a_bool() -> None:
    with pytest.raises(MoeEpUsageError, match="topk_weight_before_fc2 must be a bool, got 1"):
        Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig(topk_weight_before_fc2=1)  # type: ignore[arg-type]

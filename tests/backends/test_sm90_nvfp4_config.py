"""`Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig`: the MXFP4 kernel's fixed contract, the two
NVFP4 knobs and their rules (`MoeEpUsageError` naming the field, the rule and the value), and
both knobs reaching the drop kernel's constructor (honoured, not ignored)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from backend_testing import require_drop, run_fresh_python

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.common.pull_drop import PULL_DROP
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig as Config,
)
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.upstream import NVFP4_DROP

PROBLEM = dict(
    hidden_size=256, intermediate_size=128, top_k=4, num_experts=8, world_size=2,
    max_tokens_per_rank=64,
)  # fmt: skip


def test_defaults() -> None:
    cfg = Config()
    assert cfg.kernel_name == "sm90_fp8_nvfp4_bf16_pull_cutedsl"
    assert cfg.nvfp4_kperm == 64 and cfg.nvfp4_fc1_k256_overlap is False  # upstream's
    assert cfg.swap_ab is True and cfg.fp8_scale_mode == "mxfp4_hybrid"
    cfg.check_problem(**PROBLEM)
    for kperm in (0, 32, 64):
        assert Config(nvfp4_kperm=kperm).nvfp4_kperm == kperm
    assert Config(nvfp4_fc1_k256_overlap=True, mma_tiler_mnk=(128, 64, 256)).nvfp4_fc1_k256_overlap


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("nvfp4_kperm", 16, "one of (0, 32, 64)"),
        ("nvfp4_kperm", True, "one of (0, 32, 64)"),
        ("nvfp4_kperm", 64.0, "one of (0, 32, 64)"),
        ("nvfp4_fc1_k256_overlap", None, "None, a pick from its tuned table, is not offered"),
        ("nvfp4_fc1_k256_overlap", 1, "True or False"),
        ("nvfp4_fc1_k256_overlap", True, "needs a K256 tile"),
        ("swap_ab", False, "swap-AB only"),
        ("fp8_scale_mode", "blockwise", "one fp32 FC1 activation scale per token"),
        ("combine_format", "mxfp8", "bf16 only"),
        ("generate_c", True, "writes no FC1 output"),
        ("enable_in_kernel_fc2_reduce", True, "after the kernel"),
        ("mma_tiler_mnk", (128, 64, 64), "multiple of 128"),
    ],
)
def test_bad_knobs_are_refused(field: str, value: Any, rule: str) -> None:
    with pytest.raises(MoeEpUsageError, match=field) as err:
        Config(**{field: value})
    assert rule in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize(
    ("field", "value"), [("hidden_size", 192), ("intermediate_size", 64), ("top_k", 33)]
)
def test_problem_rules(field: str, value: int) -> None:
    with pytest.raises(MoeEpUsageError, match=field) as err:
        Config().check_problem(**{**PROBLEM, field: value})
    assert str(value) in str(err.value)


@pytest.mark.parametrize(("kperm", "overlap"), [(0, False), (32, False), (64, True)])
def test_the_knobs_reach_the_drop_kernel(kperm: int, overlap: bool) -> None:
    """`build_kernel` constructs the drop's class with both knobs (no compile, no GPU)."""
    require_drop(PULL_DROP, cutlass=True)
    require_drop(NVFP4_DROP, cutlass=True)
    tile = (128, 64, 256) if overlap else (128, 64, 128)
    code = f"""
import json
from moe_ep.backends.support.cutedsl.compile_fakes import DEFAULT_CHECK_GEOMETRY
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.args import build_kernel
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig as C,
)
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.upstream import load_nvfp4_api
cfg = C(nvfp4_kperm={kperm}, nvfp4_fc1_k256_overlap={overlap}, mma_tiler_mnk={tile})
kernel, _ = build_kernel(cfg, DEFAULT_CHECK_GEOMETRY, load_nvfp4_api())
print(json.dumps(dict(
    cls=type(kernel).__name__, kperm=kernel.nvfp4_conversion.kperm,
    overlap=kernel.nvfp4_fc1_k256_overlap, mode=kernel.fp8_scale_mode,
    k=int(kernel.mma_tiler[2]),
)))
"""
    got = run_fresh_python(code)
    assert got == dict(
        cls="Sm90MegaMoESwapABNvfp4Fp8Kernel", kperm=kperm, overlap=overlap,
        mode="mxfp4_hybrid", k=tile[2],
    ), json.dumps(got)  # fmt: skip

"""`Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig`: the MXFP4 kernel's fixed contract and
geometry rules, refused with `MoeEpUsageError` naming the field, the rule and the value."""

from __future__ import annotations

from typing import Any

import pytest

from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.config import (
    Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig as Config,
)

PROBLEM = dict(
    hidden_size=256, intermediate_size=128, top_k=4, num_experts=8, world_size=2,
    max_tokens_per_rank=64,
)  # fmt: skip


def test_defaults_are_the_fixed_contract() -> None:
    cfg = Config()
    assert cfg.kernel_name == "sm90_fp8_mxfp4_bf16_pull_cutedsl"
    assert cfg.swap_ab is True and cfg.fp8_scale_mode == "mxfp4_hybrid"
    assert cfg.generate_c is False and cfg.combine_format == "bf16"
    assert cfg.enable_in_kernel_fc2_reduce is False
    cfg.check_problem(**PROBLEM)
    assert cfg.token_padding_block == 64  # swap-AB: the N tile holds tokens


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("swap_ab", False, "swap-AB only"),
        ("swap_ab", 1, "swap-AB only"),
        ("fp8_scale_mode", "blockwise", "one fp32 FC1 activation scale per token"),
        ("fp8_scale_mode", "per_tensor", "one fp32 FC1 activation scale per token"),
        ("generate_c", True, "writes no FC1 output"),
        ("generate_c", 0, "writes no FC1 output"),
        ("combine_format", "mxfp8", "bf16 only"),
        ("enable_in_kernel_fc2_reduce", True, "after the kernel"),
        ("mma_tiler_mnk", (128, 64, 64), "multiple of 128"),
        ("mma_tiler_mnk", (64, 64, 128), "swap-AB layout needs M in"),
    ],
)
def test_the_fixed_contract_and_bad_tiles_are_refused(field: str, value: Any, rule: str) -> None:
    with pytest.raises(MoeEpUsageError, match=field) as err:
        Config(**{field: value})
    assert rule in str(err.value) and repr(value) in str(err.value)


@pytest.mark.parametrize(("field", "value"), [("hidden_size", 192), ("intermediate_size", 64)])
def test_h_and_i_must_be_multiples_of_128(field: str, value: int) -> None:
    with pytest.raises(MoeEpUsageError, match=f"{field} must be a multiple of 128") as err:
        Config().check_problem(**{**PROBLEM, field: value})
    assert "offset folds" in str(err.value)

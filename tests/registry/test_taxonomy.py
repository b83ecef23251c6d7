"""Kernel names parse into their taxonomy parts and format back; bad names are rejected."""

from __future__ import annotations

import pytest

from moe_ep.errors import MoeEpUsageError
from moe_ep.registry import parse_kernel_name


@pytest.mark.parametrize(
    ("name", "parts", "config_class"),
    [
        (
            "sm90_fp8_fp8_bf16_pull_cutedsl",
            ("sm90", "fp8", "fp8", "bf16", "pull_cutedsl"),
            "Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig",
        ),
        (
            "sm100_fp8_fp4_bf16_deepgemm",
            ("sm100", "fp8", "fp4", "bf16", "deepgemm"),
            "Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig",
        ),
        (
            "sm100_nvfp4_nvfp4_bf16_cutedsl",
            ("sm100", "nvfp4", "nvfp4", "bf16", "cutedsl"),
            "Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig",
        ),
        (
            "any_bf16_bf16_bf16_torch",
            ("any", "bf16", "bf16", "bf16", "torch"),
            "Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig",
        ),
    ],
)
def test_parse_and_format(name: str, parts: tuple[str, ...], config_class: str) -> None:
    parsed = parse_kernel_name(name)
    assert (parsed.arch, parsed.act, parsed.weight, parsed.out, parsed.style) == parts
    assert str(parsed) == name
    assert parsed.config_class_name == config_class


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        ("deep_gemm_mega", "does not parse"),
        ("sm90_fp8_fp8_bf16", "does not parse"),
        ("sm90_fp9_fp8_bf16_torch", "act dtype 'fp9'"),
        ("sm90_fp8_fp8_bf16_Pull", "style 'Pull'"),
        ("gpu_fp8_fp8_bf16_torch", "arch 'gpu'"),
        ("sm90_fp8_fp8_bf16_pull__x", "style"),
    ],
)
def test_bad_names_are_rejected(name: str, fragment: str) -> None:
    with pytest.raises(MoeEpUsageError, match=fragment) as info:
        parse_kernel_name(name)
    assert repr(name) in str(info.value)


def test_non_string_name() -> None:
    with pytest.raises(MoeEpUsageError, match="must be a str, got int"):
        parse_kernel_name(90)  # type: ignore[arg-type]

"""The CLI's portable kernels and oracle formats are read from the registry, not listed."""

from __future__ import annotations

import dataclasses

import pytest

import moe_ep.registry
from moe_ep.cli import jobs
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import FORMATS
from moe_ep.registry import KernelInfo, parse_kernel_name

# What each taxonomy (act, weight) pair is checked against: the oracle's own recipes.
EXPECTED = {
    ("bf16", "bf16"): "bf16",
    ("fp8", "fp8"): "fp8",
    ("mxfp8", "mxfp8"): "mxfp8",
    ("nvfp4", "nvfp4"): "nvfp4",
    ("fp8", "fp4"): "fp8_fp4",
    ("fp8", "mxfp4"): "fp8_mxfp4",
    ("fp8", "nvfp4"): "fp8_nvfp4",
    ("mxfp8", "mxfp4"): "mxfp8_mxfp4",
}


def test_the_registered_portable_kernels_cover_every_oracle_format() -> None:
    assert jobs.oracle_formats() == EXPECTED
    assert sorted(EXPECTED.values()) == sorted(FORMATS)
    assert len(jobs.portable_kernels()) == len(FORMATS)
    assert jobs.oracle_format("sm90_fp8_fp8_bf16_push_cuda") == "fp8"
    assert jobs.oracle_format("sm100_fp8_fp4_bf16_deepgemm") == "fp8_fp4"
    with pytest.raises(MoeEpUsageError, match="no oracle format"):
        jobs.oracle_format("sm100_bf16_mxfp8_bf16_cutedsl")


def test_a_newly_registered_portable_kernel_is_listed_and_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A portable kernel that only the registry knows (no edit of the CLI) is run by `demo`
    and gives its (act, weight) tags an oracle format."""
    real_infos, real_get = moe_ep.registry.available_kernels, moe_ep.registry.get_kernel
    name = "any_bf16_mxfp8_bf16_torch"

    class NewKernel:
        oracle_format = "mxfp8"

    extra = KernelInfo(name=name, available=True, reason="", taxonomy=parse_kernel_name(name))

    def infos() -> list[KernelInfo]:
        return [*real_infos(), dataclasses.replace(extra)]

    monkeypatch.setattr(moe_ep.registry, "available_kernels", infos)
    monkeypatch.setattr(
        moe_ep.registry, "get_kernel", lambda n: NewKernel if n == name else real_get(n)
    )
    assert name in jobs.portable_kernels()
    assert name in jobs._demo_kernels()
    assert jobs.oracle_format("sm100_bf16_mxfp8_bf16_cutedsl") == "mxfp8"

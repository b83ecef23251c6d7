"""The CuTe DSL kernels refuse an nvidia-cutlass-dsl older than their drop's release needs:
flashinfer-python 0.7.4 (both CuTe DSL drops' source) requires nvidia-cutlass-dsl>=4.8.0."""

from __future__ import annotations

import importlib.metadata

import pytest

from moe_ep.backends.support import availability
from moe_ep_sm90.kernels.sm90_bf16_bf16_bf16_pull_cutedsl.kernel import (
    Sm90Bf16Bf16Bf16PullCutedslKernel,
)
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.kernel import (
    Sm90Fp8Fp8Bf16PullCutedslKernel,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.kernel import (
    Sm100Mxfp8Mxfp8Bf16CutedslKernel,
)
from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.kernel import (
    Sm100Nvfp4Nvfp4Bf16CutedslKernel,
)

KERNELS = [
    Sm90Fp8Fp8Bf16PullCutedslKernel,
    Sm90Bf16Bf16Bf16PullCutedslKernel,
    Sm100Nvfp4Nvfp4Bf16CutedslKernel,
    Sm100Mxfp8Mxfp8Bf16CutedslKernel,
]


def _installed(monkeypatch: pytest.MonkeyPatch, cutlass_dsl: str) -> None:
    real = importlib.metadata.version

    def version(dist: str) -> str:
        return cutlass_dsl if dist == "nvidia-cutlass-dsl" else real(dist)

    monkeypatch.setattr(availability.importlib.metadata, "version", version)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.kernel_name)
@pytest.mark.parametrize("old", ["4.7.1", "4.7.99.post1", "3.12.0"])
def test_an_older_cutlass_dsl_is_refused_naming_both_versions(monkeypatch, kernel, old):
    _installed(monkeypatch, old)
    ok, why = kernel.availability()
    assert not ok
    assert f"python package 'nvidia-cutlass-dsl' is {old};" in why
    assert "(flashinfer-python 0.7.4) needs >= 4.8.0" in why


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.kernel_name)
@pytest.mark.parametrize("new", ["4.8.0", "4.8.1", "4.10.0", "5.0.0.dev1"])
def test_a_cutlass_dsl_at_or_above_the_floor_is_not_blamed(monkeypatch, kernel, new):
    _installed(monkeypatch, new)
    _, why = kernel.availability()  # still unavailable here: no GPU
    assert "nvidia-cutlass-dsl" not in why


def test_a_floor_of_a_distribution_not_installed_is_left_to_missing_packages():
    assert availability.outdated_packages((("no-such-dist-moe-ep", "1.0", "x"),)) == []

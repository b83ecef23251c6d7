"""`benchlib.baseline_kernel`: `layer_speed --baseline-kernel` really runs the other library.

The reference is a library built from a source that differs from the current one in a
known way (its expert GEMM writes a constant), so a call that stayed on the current
library, or one that kept the baseline after the switch ended, shows in the output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchlib import baseline_kernel

from moe_ep.backends.portable import cpu_fused, recipes

pytestmark = pytest.mark.skipif(cpu_fused.library() is None, reason="no fused CPU library")

ENTRY = "int32_t moe_ep_expert_gemm_v2("


def _gemm() -> torch.Tensor:
    x = torch.ones(2, 16, dtype=torch.bfloat16)
    w = cpu_fused.StoredWeight(torch.ones(1, 3, 16, dtype=torch.bfloat16), "bf16")
    groups = cpu_fused.ExpertGroups(torch.tensor([0, 2]), torch.tensor([0]), torch.tensor([0]))
    out = torch.zeros(2, 3)
    scratch = torch.empty(cpu_fused.expert_gemm_scratch(2, 16))
    assert cpu_fused.expert_gemm(x, None, groups, w, out, scratch)
    return out


def test_calls_inside_go_to_the_baseline_and_return_after(tmp_path: Path) -> None:
    src = cpu_fused.SOURCE.read_text()
    assert src.count(ENTRY) == 1
    # the baseline's entry point fills every output with 7 and does nothing else
    marked = src.replace(
        ENTRY,
        "int32_t moe_ep_expert_gemm_unused(",
    ) + (
        "\nint32_t moe_ep_expert_gemm_v2(const void *x, int64_t ld_x, int32_t x_kind,"
        " const int64_t *x_rows, int64_t groups, const int64_t *q_start,"
        " const int64_t *g_expert, const int64_t *out_row0, const int64_t *g_rows,"
        " const float *alpha,"
        " const void *w, int64_t w_expert_bytes, int64_t w_row_bytes, int32_t w_kind,"
        " const void *s, int64_t s_expert_bytes, int64_t s_row_bytes, int32_t s_kind,"
        " int64_t s_block, void *out, int64_t ld_out, int32_t out_kind, int64_t n, int64_t k,"
        " float *xs, int32_t threads, int32_t vector) {\n"
        "    for (int64_t q = 0; q < q_start[groups]; q++)\n"
        "        for (int64_t j = 0; j < n; j++) ((float *)out)[q * ld_out + j] = 7.0f;\n"
        "    return 0;\n}\n"
    )
    path = tmp_path / "cpu_fused.c"
    path.write_text(marked)
    lib = baseline_kernel.build(path)
    assert path != cpu_fused.SOURCE  # build() put the current source back
    assert torch.equal(_gemm(), torch.full((2, 3), 16.0))
    on_baseline = baseline_kernel.with_library(lib, _gemm)()
    assert isinstance(on_baseline, torch.Tensor)
    assert torch.equal(on_baseline, torch.full((2, 3), 7.0))
    assert torch.equal(_gemm(), torch.full((2, 3), 16.0))


def test_a_source_that_does_not_build_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "cpu_fused.c"
    path.write_text("this is not C\n")
    with pytest.raises(RuntimeError):
        baseline_kernel.build(path)


def test_a_source_older_than_the_fused_requantize_runs_it_eagerly(tmp_path: Path) -> None:
    """An older `cpu_fused.c` without `moe_ep_fake_quant` still builds as a baseline; on it
    the FC2-input requantization goes the eager way (the same bits), as that commit did."""
    src = cpu_fused.SOURCE.read_text()
    assert "moe_ep_fake_quant(" in src
    path = tmp_path / "cpu_fused.c"
    path.write_text(src.replace("moe_ep_fake_quant(", "moe_ep_fake_quant_renamed("))
    lib = baseline_kernel.build(path)
    assert not hasattr(lib, "moe_ep_fake_quant")
    recipe = recipes.Nvfp4Recipe(hidden_global_scale=2.0)
    x = torch.randn(4, 64)
    want = recipe.requantize(x.clone()).bfloat16()
    used: list[bool] = []
    real = cpu_fused.fake_quant

    def spy(x: torch.Tensor, out: torch.Tensor, spec: cpu_fused.FakeQuant) -> bool:
        used.append(real(x, out, spec))
        return used[-1]

    out = torch.empty_like(want)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_fused, "fake_quant", spy)
        baseline_kernel.with_library(lib, lambda: recipe.requantize_into(x, out))()
        assert used == [False] and torch.equal(out, want)  # eager on the baseline
        out.zero_()
        recipe.requantize_into(x, out)
        assert used == [False, True] and torch.equal(out, want)  # fused on the current one

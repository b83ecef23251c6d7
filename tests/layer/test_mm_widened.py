"""The `mm` blocks' bf16 GEMM on CPUs without oneDNN bf16 kernels: fp32 `mm` on widened
weights, WIDEN_COLS output columns at a time (`experts._mm_widened`), against float64."""

from __future__ import annotations

import pytest
import torch

from moe_ep.backends.portable import experts
from moe_ep.backends.portable.comm import Workspace

# (rows, K, N): one row to a few hundred, N below, at and past the column block (partial
# last blocks), odd K
SHAPES = [(1, 3, 1), (5, 19, 37), (300, 64, 256), (7, 64, 300), (2, 19, 2 * experts.WIDEN_COLS + 1)]


def _operands(b: int, k: int, n: int, seed: int, ints: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if ints:  # every product and partial sum exact in fp32, every result exact in bf16
        a = torch.randint(-1, 2, (b, k), generator=g)
        w_nk = torch.randint(-1, 2, (n, k), generator=g)
    else:
        a, w_nk = torch.randn(b, k, generator=g), torch.randn(n, k, generator=g)
    return a.bfloat16(), w_nk.bfloat16().t()  # w: [K, N], a view of K-major [N, K] (as w13t)


def _widened(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = torch.full((int(a.shape[0]), int(w.shape[1])), float("nan"), dtype=torch.bfloat16)
    experts._mm_widened(a, w, out, Workspace(), "t")
    return out


@pytest.mark.parametrize(("b", "k", "n"), SHAPES)
def test_widened_mm_is_exact_where_every_sum_is_exact(b: int, k: int, n: int) -> None:
    a, w = _operands(b, k, n, seed=b + k + n, ints=True)
    want = (a.double() @ w.double()).bfloat16()
    assert torch.equal(_widened(a, w), want)  # every column block written, none shifted


def test_widened_mm_rounds_fp32_sums_to_nearest_bf16() -> None:
    b, k, n = 9, 1000, experts.WIDEN_COLS + 44
    a, w = _operands(b, k, n, seed=3, ints=False)
    ref = a.double() @ w.double()
    # fp32 accumulation: at most K * 2^-24 * sum |a||w| from the exact sum (a loose bound),
    # then one RNE rounding to bf16: half an ulp, 2^-8 of the value at most
    acc = k * 2.0**-24 * (a.double().abs() @ w.double().abs())
    err = (_widened(a, w).double() - ref).abs()
    assert bool((err <= 2.0**-8 * (ref.abs() + acc) + acc).all())
    assert float((err / ref.abs()).max()) > 2.0**-10  # the data exercise the rounding


def test_mm_takes_the_widened_blocks_for_cpu_bf16_only_without_onednn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(experts, "_mm_widened", lambda a, w, out, ws, name: calls.append(name))
    a, w = _operands(4, 16, 8, seed=1, ints=True)
    out = torch.empty(4, 8, dtype=torch.bfloat16)
    for onednn in (True, False):
        monkeypatch.setattr(experts, "_onednn_bf16", lambda onednn=onednn: onednn)
        experts._mm(a, w, out, Workspace(), "fc1_t")
        experts._mm(a.float(), w.float(), out.float(), Workspace(), "fc1_t")  # fp32 weights
    assert calls == ["fc1_t"]

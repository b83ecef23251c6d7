"""NaN / inf activations: the token's row comes out all NaN, nothing else changes.

The rule (docs/layer.md, docs/quant.md): nothing is refused (no isfinite pass, no host sync
per forward); a quantization block holding NaN / inf gets a NaN scale, so a token with a
non-finite activation is dispatched as NaN, its output row is all NaN, and every other row
is bit-identical to the forward without it. Checked for every portable format at EP1 and
EP2, with and without a SwiGLU clamp, against the oracle (which predicts the NaN row), and
at the quantizer level for every format.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from layer_cases import KERNELS, Case, from_wire, make_problem, to_wire

import moe_ep.quant as q
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.spawn import spawn_local

T, H, I, E, K = 16, 256, 128, 8, 4  # noqa: E741 - I is the glossary name
BAD_TOKEN = 11  # on rank 1 at EP2; its experts sit on both ranks
BAD_COL = 70
UNROUTED_TOKEN = 5  # every slot -1: no expert reads it, so its inf must not matter
CLAMP = 0.75
VARIANTS = {"clean": None, "+inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
CONFIGS: dict[str, tuple[tuple[str, Any], ...]] = {
    "plain": (),
    "clamp": (("swiglu_clamp", CLAMP),),
}
JOBS = [(fmt, cfg) for fmt in KERNELS for cfg in CONFIGS]


def _problem() -> dict[str, torch.Tensor]:
    """The layer_cases problem, with one token routed nowhere and every expert's gate
    weights in column BAD_COL positive: a +inf there then drives every gate to +inf, which
    a clamp would turn back into finite values (bf16 without the inf -> NaN rule)."""
    p = make_problem(Case("nonfinite", tokens=T, hidden=H, inter=I, experts=E, topk=K), 2)
    p["ids"][UNROUTED_TOKEN] = -1
    p["w13"][:, :I, BAD_COL] = p["w13"][:, :I, BAD_COL].abs() + 0.01
    return p


def _hidden(variant: str) -> torch.Tensor:
    x = _problem()["x"].clone()
    bad = VARIANTS[variant]
    if bad is not None:
        x[BAD_TOKEN, BAD_COL] = bad
        x[UNROUTED_TOKEN, 3] = float("inf")
    return x


def _worker(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> dict[str, np.ndarray]:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep.registry import get_kernel
    from moe_ep.runtime import acquire

    torch.set_num_threads(1)
    boot = BootstrapConfig(world_size, rank, timeout_s=60.0)
    keep = acquire(boot)
    try:
        p = _problem()
        el, tl = E // world_size, T // world_size
        experts, tokens = slice(rank * el, (rank + 1) * el), slice(rank * tl, (rank + 1) * tl)
        out: dict[str, np.ndarray] = {}
        for fmt, cfg in jobs:
            kernel = get_kernel(KERNELS[fmt])
            layer = MoEEpLayer(
                boot,
                FleetParams(E, tl, H),
                MoEWeightPack(p["w13"][experts], p["w2"][experts]),
                kernel.config_cls(**dict(CONFIGS[cfg])),
            )
            try:
                # "clean" again last: a NaN forward must leave nothing behind in the workspace
                for variant in [*VARIANTS, "clean"]:
                    x = _hidden(variant)[tokens]
                    y = layer(MoEEpTensors(x, p["ids"][tokens], p["topk_weights"][tokens]))
                    key = f"{fmt}/{cfg}/{variant}"
                    out[key + ("_again" if key in out else "")] = to_wire(y)
            finally:
                layer.destroy()
        return out
    finally:
        keep.release()


@cache
def _run(world_size: int, fused: str | None = None) -> dict[str, torch.Tensor]:
    env = None if fused is None else {"MOE_EP_CPU_FUSED": fused}
    ranks = spawn_local(_worker, world_size, JOBS, timeout_s=240, env=env)
    return {key: torch.cat([from_wire(r[key]) for r in ranks]) for key in ranks[0]}


@cache
def _oracle_for(fmt: str, cfg: str, variant: str) -> Any:
    p = _problem()
    clamp = dict(CONFIGS[cfg]).get("swiglu_clamp")
    x = _hidden(variant)
    return oracle_forward(
        x, p["ids"], p["topk_weights"], p["w13"], p["w2"], fmt=fmt, swiglu_clamp=clamp
    )


def _others(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t[:BAD_TOKEN], t[BAD_TOKEN + 1 :]])


def _check(got: dict[str, torch.Tensor], label: str) -> None:
    failures = []
    for fmt, cfg in JOBS:
        clean = got[f"{fmt}/{cfg}/clean"]
        if not torch.equal(got[f"{fmt}/{cfg}/clean_again"], clean):
            failures.append(f"{fmt}/{cfg}: a clean forward after the NaN ones differs")
        assert bool(torch.isfinite(clean).all())
        for variant in ("+inf", "-inf", "nan"):
            y, name = got[f"{fmt}/{cfg}/{variant}"], f"{fmt}/{cfg}/{variant} at {label}"
            row = y[BAD_TOKEN].float()
            if not bool(row.isnan().all()):
                failures.append(
                    f"{name}: bad token's row has {int((~row.isnan()).sum())} non-NaN cells, "
                    f"max |finite| {float(row.nan_to_num(0, 0, 0).abs().max()):.4g}"
                )
            if not torch.equal(_others(y), _others(clean)):
                failures.append(f"{name}: another token's row changed")
            report = compare_to_oracle(y, _oracle_for(fmt, cfg, variant))
            if not report.ok:
                failures.append(f"{name}: oracle disagrees: {report}")
    assert not failures, "\n".join(failures)


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", [1, 2])
def test_nonfinite_token_gives_a_nan_row_and_changes_nothing_else(world_size: int) -> None:
    _check(_run(world_size), f"EP{world_size}")


@pytest.mark.multirank
def test_same_rule_on_the_eager_cpu_path() -> None:
    """MOE_EP_CPU_FUSED=0: torch's SwiGLU clamp and combine instead of the C library."""
    _check(_run(1, "0"), "EP1 eager")


def test_oracle_predicts_the_rule() -> None:
    for fmt, cfg in JOBS:
        for variant in ("+inf", "-inf", "nan"):
            exact = _oracle_for(fmt, cfg, variant).exact
            assert bool(exact[BAD_TOKEN].isnan().all()), (fmt, cfg, variant)
            assert bool(_others(exact).isfinite().all()), (fmt, cfg, variant)
            assert torch.equal(exact[UNROUTED_TOKEN], torch.zeros(H, dtype=torch.float64))
            assert torch.equal(_others(exact), _others(_oracle_for(fmt, cfg, "clean").exact))


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_compare_to_oracle_nan_agrees_only_where_predicted(fmt: str) -> None:
    """NaN where the oracle says NaN passes; planted faults around the NaN row still fail."""
    ref = _oracle_for(fmt, "plain", "nan")
    good = ref.output.clone()
    assert compare_to_oracle(good, ref).ok
    faults: dict[str, torch.Tensor] = {}
    faults["finite cell in the NaN row"] = good.clone()
    faults["finite cell in the NaN row"][BAD_TOKEN, 9] = 0.0
    faults["NaN in another row"] = good.clone()
    faults["NaN in another row"][2, 9] = float("nan")
    faults["inf in another row"] = good.clone()
    faults["inf in another row"][2, 9] = float("inf")
    faults["other rows scaled by 1.05"] = good * 1.05  # the global check still sees it
    for name, out in faults.items():
        report = compare_to_oracle(out, ref)
        assert not report.ok, f"{name} passed: {report}"


# -- the quantizer rule ---------------------------------------------------------------------
def _fp8_block(fmt: str, block: int) -> Any:
    def qdq(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        d, s = q.quantize_fp8_blockwise(x, block=(1, block), scale_format=fmt, check_finite=False)
        return (d, s), q.dequantize_fp8_blockwise(d, s, block=(1, block))

    return qdq


def _mxfp8(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    d, s = q.quantize_mxfp8(x, check_finite=False)
    return (d, s), q.dequantize_mxfp8(d, s)


def _mxfp4(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    d, s = q.quantize_mxfp4(x, check_finite=False)
    return (d, s), q.dequantize_mxfp4(d, s)


def _nvfp4(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    d, s = q.quantize_nvfp4(x, norm_const=1234.5, check_finite=False)
    return (d, s), q.dequantize_nvfp4(d, s, norm_const=1234.5)


def _per_row(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    d, s = q.quantize_fp8_per_row(x, check_finite=False)
    return (d, s), q.dequantize_fp8_per_row(d, s)


# name -> (quantize-dequantize, elements per scale along K, elements per payload byte)
QUANTIZERS: dict[str, tuple[Any, int, float]] = {
    "fp8 1x128 fp32": (_fp8_block("fp32", 128), 128, 1),
    "fp8 1x32 ue8m0": (_fp8_block("ue8m0", 32), 32, 1),
    "fp8 per row": (_per_row, 256, 1),
    "mxfp8": (_mxfp8, 32, 1),
    "mxfp4": (_mxfp4, 32, 2),
    "nvfp4": (_nvfp4, 16, 2),
}


def _nan_scale(s: torch.Tensor) -> bool:
    if s.dtype == torch.uint8:  # E8M0
        return int(s) == 255
    if s.dtype == torch.float8_e4m3fn:
        return int(s.view(torch.uint8)) == 0x7F
    return bool(torch.isnan(s))


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_nonfinite_block_gets_a_nan_scale_and_nothing_else_changes(name: str, bad: float) -> None:
    qdq, block, per_byte = QUANTIZERS[name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 256, generator=g) * 3
    x[1, 32:64] = 0.0  # a zero block in every format but per-row: still its own rule
    col = 37
    xb = x.clone()
    xb[2, col] = bad
    (d0, s0), v0 = qdq(x)
    (d1, s1), v1 = qdq(xb)
    b = col // block
    assert _nan_scale(s1[2, b]), f"{name}: scale {s1[2, b]!r}"
    lo, hi = b * block, (b + 1) * block
    assert bool(v1[2, lo:hi].isnan().all())
    others = torch.ones_like(v1, dtype=torch.bool)
    others[2, lo:hi] = False
    assert torch.equal(v1[others], v0[others])
    assert bool(v1[others].isfinite().all())
    keep_s = torch.ones_like(s0, dtype=torch.bool)
    keep_s[2, b] = False
    assert torch.equal(s1[keep_s].view(torch.uint8), s0[keep_s].view(torch.uint8))
    keep_d = torch.ones(d0.shape, dtype=torch.bool)
    keep_d[2, int(lo / per_byte) : int(hi / per_byte)] = False
    assert torch.equal(d1.view(torch.uint8)[keep_d], d0.view(torch.uint8)[keep_d])


def test_per_tensor_fp8_poisons_the_whole_tensor() -> None:
    x = torch.randn(3, 64)
    x[1, 2] = float("inf")
    d, s = q.quantize_fp8_per_tensor(x, check_finite=False)
    assert bool(torch.isnan(s)) and bool(q.dequantize_fp8_per_tensor(d, s).isnan().all())


def test_e8m0_bytes_of_a_nan_scale_are_255() -> None:
    x = torch.randn(2, 64)
    x[0, 5] = float("-inf")
    _, s = q.quantize_fp8_blockwise(x, block=(1, 32), scale_format="ue8m0", check_finite=False)
    assert q.float32_pow2_to_e8m0(s).tolist()[0][0] == 255
    assert q.e8m0_to_float32(q.float32_pow2_to_e8m0(s))[0, 0].isnan()
    with pytest.raises(MoeEpUsageError, match="powers of two"):
        q.float32_pow2_to_e8m0(torch.tensor([float("inf")]))


def test_nonfinite_to_nan_keeps_every_other_bit() -> None:
    finite = [0.0, -0.0, 1.5, -3.0, 1e-40, -1e-40, 3e38]  # 1e-40: a bf16 subnormal
    x = torch.tensor([*finite, float("inf"), float("-inf"), float("nan")]).bfloat16()
    y = q.nonfinite_to_nan(x)
    assert y.dtype == torch.bfloat16
    n = len(finite)
    assert torch.equal(y[:n].view(torch.int16), x[:n].view(torch.int16))
    assert bool(y[n:].isnan().all())


# -- weights: refused at construction, before any collective --------------------------------
@pytest.mark.parametrize("fmt", sorted(KERNELS))
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_nonfinite_weights_are_refused_at_construction(fmt: str, bad: float) -> None:
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEWeightPack

    p = _problem()
    w13 = p["w13"][:4].clone()
    w13[1, 3, 4] = bad
    # world size 4 with no rendezvous address: getting the error proves it comes first
    with pytest.raises(MoeEpUsageError, match="w13 has non-finite values"):
        MoEEpLayer(
            BootstrapConfig(4, 1),
            FleetParams(16, 4, H),
            MoEWeightPack(w13, p["w2"][:4]),
            KERNELS[fmt],
        )

"""Dense single-process reference of the EP MoE layer, and the per-cell tolerance band.

`oracle_forward` takes the GLOBAL inputs (every rank's tokens concatenated in rank order)
and ALL experts' weights, and computes in float64 what every kernel approximates: quantize
the activations and weights with the format's recipe (`moe_ep.quant`), `[g; u] = w13 @ x`,
`h = silu(g) * u` (optional clamp), requantize h, `y = w2 @ h`, `out = sum_k w_k * y_k`.
For the bf16 format the FC1 output `[g; u]` is rounded to bf16 first (a bf16 GEMM's output,
as in unfused bf16 MoE pipelines; `fc1_output_high_precision` keeps it, as the fused sm90
bf16 pull kernel does); the quantized formats keep it in high precision, as the fused GPU
kernels do (fp32 accumulators feed SwiGLU).
It loops over experts (not the kernels' grouping) and shares no code with the portable
backend beyond `moe_ep.quant`.

Band (DESIGN section 5): per output cell, `ulps * eps_bf16 * sum_k |w_k * y_k| + flip +
atol` with eps_bf16 = 2**-7, i.e. a few bf16 ulps of the magnitude of the terms summed, plus
an allowance for one requantization flip of the FC2 input (`tolerance_band`). Beside it, a
global check: the relative Frobenius error and the least-squares slope of the output against
the exact value, within a per-format bound (`global_bound`), which sees what a loose cell
band cannot: a scaled output, a misrouted pair, a skipped requantization.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_ep import quant
from moe_ep.compat.renames import either_name
from moe_ep.errors import MoeEpUsageError

__all__ = [
    "FORMATS",
    "OracleResult",
    "ToleranceReport",
    "compare_to_oracle",
    "global_bound",
    "grid_rel_error",
    "oracle_forward",
    "tolerance_band",
]

FORMATS = ("bf16", "fp8", "mxfp8", "nvfp4", "fp8_fp4", "fp8_mxfp4", "fp8_nvfp4", "mxfp8_mxfp4")
"""Activation/weight formats, named as in `any_<fmt>_..._torch` (fp8_fp4: act fp8, w fp4;
fp8_mxfp4: the sm90 MXFP4 kernel's `mxfp4_hybrid` recipe, `moe_ep.quant.mxfp4_hybrid`;
fp8_nvfp4: the sm90 NVFP4 kernel's, the same activations, `moe_ep.quant.nvfp4_hopper`;
mxfp8_mxfp4: the sm100 MXFP4 x MXFP8 kernel's, normal E8M0 scales on FC1 input and weights)."""

EPS_BF16 = 2.0**-7
# Largest spacing of the FC2-input format's grid relative to the value rounded (one flip).
_ACT_REL_STEP = {
    "bf16": 2.0**-7,
    "fp8": 2.0**-3,
    "mxfp8": 2.0**-3,
    "fp8_fp4": 2.0**-3,
    "fp8_mxfp4": 2.0**-3,
    "fp8_nvfp4": 2.0**-3,
    "mxfp8_mxfp4": 2.0**-3,
    "nvfp4": 1.0,
}
# Stored mantissa bits of the FC2-input element format (bf16, e4m3, e2m1): `global_bound`.
_ACT_MANTISSA_BITS = {
    "bf16": 7, "fp8": 3, "mxfp8": 3, "fp8_fp4": 3, "fp8_mxfp4": 3, "fp8_nvfp4": 3,
    "mxfp8_mxfp4": 3, "nvfp4": 1,
}  # fmt: skip
_FLIP_CHUNK = 32
DEFAULT_ULPS = 4.0
DEFAULT_ATOL = 1e-6


@dataclass(frozen=True)
class OracleResult:
    """output: `[T, H]` bf16; exact: `[T, H]` float64 before the cast; terms: `[T, H]`
    float64 `sum_k |w_k * y_k|`; flip: `[T, H]` float64, the most one requantization flip of
    the FC2 input per (token, slot) can move a cell (see `tolerance_band`); fmt: the format
    (one of `FORMATS`), which sets the global bound (`global_bound`)."""

    output: torch.Tensor
    exact: torch.Tensor
    terms: torch.Tensor
    flip: torch.Tensor
    fmt: str


def _qdq_act(
    x: torch.Tensor, fmt: str, global_scale: float, fp8_block: int = 128, fc2: bool = False
) -> torch.Tensor:
    """Quantize-dequantize activations `[m, K]` per token (no global scale folded back);
    fp8 in 1 x `fp8_block` blocks; fp8_mxfp4 and fp8_nvfp4 one scale per row for the FC1
    input, 1x64 blocks for the FC2 input (`fc2`). NaN / inf are not refused: a block holding one
    dequantizes to NaN (bf16: inf -> NaN), the kernels' rule (`moe_ep.quant.nonfinite`), so
    such a token's predicted row is all NaN."""
    x = x.float()
    if fmt == "bf16":
        return quant.nonfinite_to_nan(x.to(torch.bfloat16)).double()
    if fmt in ("fp8", "fp8_fp4"):  # fp8: DeepSeek-V3 1x128 fp32; fp8_fp4: DeepGEMM 1x32 UE8M0
        sf, b = ("fp32", fp8_block) if fmt == "fp8" else ("ue8m0", 32)
        d, s = quant.quantize_fp8_blockwise(x, block=(1, b), scale_format=sf, check_finite=False)
        return quant.dequantize_fp8_blockwise(d, s, block=(1, b)).double()
    if fmt in ("fp8_mxfp4", "fp8_nvfp4") and fc2:
        d, s = quant.quantize_fp8_fc2_hybrid(x, check_finite=False)
        return quant.dequantize_fp8_blockwise(d, s, block=(1, quant.HYBRID_FC2_BLOCK)).double()
    if fmt in ("fp8_mxfp4", "fp8_nvfp4"):
        d, s = quant.quantize_fp8_per_token_hybrid(x, check_finite=False)
        return quant.dequantize_fp8_per_row(d, s).double()
    if fmt in ("mxfp8", "mxfp8_mxfp4"):  # mxfp8_mxfp4's FC1 input: normal scales
        normal = fmt == "mxfp8_mxfp4" and not fc2
        d, s = quant.quantize_mxfp8(x, rule="ceil", check_finite=False, normal_scales=normal)
        return quant.dequantize_mxfp8(d, s).double()
    if fmt == "nvfp4":
        p, s = quant.quantize_nvfp4(x, norm_const=global_scale, check_finite=False)
        return quant.dequantize_nvfp4(p, s).double()
    raise MoeEpUsageError(f"format must be one of {FORMATS}, got {fmt!r}")


def _qdq_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`[E, N, K]` -> (dequantized float64 without global scale, per-expert norm_const)."""
    if fmt == "bf16":
        return w.to(torch.bfloat16).double(), None
    if fmt == "fp8":
        d, s = quant.quantize_fp8_blockwise(w, block=(128, 128))
        return quant.dequantize_fp8_blockwise(d, s, block=(128, 128)).double(), None
    if fmt == "mxfp8":
        return quant.dequantize_mxfp8(*quant.quantize_mxfp8(w, rule="ceil")).double(), None
    if fmt in ("fp8_fp4", "mxfp8_mxfp4"):  # mxfp8_mxfp4: normal scales
        p, s = quant.quantize_mxfp4(w, rule="ceil", normal_scales=fmt == "mxfp8_mxfp4")
        return quant.dequantize_mxfp4(p, s).double(), None
    if fmt == "fp8_mxfp4":  # the sm90 kernel's exponent range, clamped per expert
        p, s = quant.clamp_mxfp4_exponent_range(*quant.quantize_mxfp4(w, rule="ceil"))
        return quant.dequantize_mxfp4(p, s).double(), None
    if fmt == "fp8_nvfp4":  # the sm90 kernel's e4m3 operand times its 8 * G per expert
        g = quant.nvfp4_decode_scale(w, dim=(-2, -1))
        op = quant.nvfp4_e4m3_operand(*quant.quantize_nvfp4_decode_scaled(w, decode_scale=g))
        return op.double() * (g.double() * quant.NVFP4_EPILOGUE_COMPENSATION), None
    if fmt == "nvfp4":
        gs = quant.nvfp4_global_scale(w, dim=(-2, -1))
        p, s = quant.quantize_nvfp4(w, norm_const=gs)
        return quant.dequantize_nvfp4(p, s).double(), gs.reshape(-1).double()
    raise MoeEpUsageError(f"format must be one of {FORMATS}, got {fmt!r}")


def oracle_forward(
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    fmt: str = "bf16",
    swiglu_clamp: float | None = None,
    act_global_scale: float = 1.0,
    hidden_global_scale: float = 1.0,
    fc1_gate_up_interleave: int | None = None,
    apply_routing_weights_before_fc2: bool | None = None,
    fc2_act_block: int = 128,
    fc1_output_high_precision: bool = False,
    topk_weight_before_fc2: bool | None = None,
) -> OracleResult:
    """Reference forward on global inputs.

    Args:
        hidden_states: `[T, H]` bf16, all ranks' tokens.
        topk_ids: `[T, k]` int, global expert ids, -1 = padded slot (contributes 0).
        topk_weights: `[T, k]` fp32.
        w13: `[E, 2I, H]` bf16/fp32 all experts (gate rows first). w2: `[E, H, I]`.
        fmt: one of `FORMATS`; weights are quantized here with the format's recipe.
        swiglu_clamp: gate clamped to `<= c`, up to `[-c, c]`, as in the kernels.
        act_global_scale / hidden_global_scale: nvfp4 static activation global scales.
        fc1_gate_up_interleave: None (default) quantizes w13 in its stored gate-then-up row
            order; b in `quant.GATE_UP_BLOCKS` interleaves gate/up rows in blocks of b first
            and de-interleaves the dequantized values (changes only formats whose weight
            blocks span rows, i.e. fp8 128x128; the sm90 pull kernel's FC1 with b=8).
        apply_routing_weights_before_fc2: True multiplies each pair's SwiGLU output by its
            top-k weight before the FC2 input is quantized, and sums the FC2 outputs
            unweighted (the sm100 kernels' and DeepGEMM's order; the portable config knob of
            the same name); None = False. `topk_weight_before_fc2` is its deprecated alias.
        fc2_act_block: fmt "fp8" only, one of `quant.FP8_FC2_ACT_BLOCKS`: the FC2 input is
            quantized in 1 x `fc2_act_block` blocks (128 DeepSeek-V3 and the sm90 push
            kernel, 64 the sm90 pull kernel); the FC1 input stays 1x128.
        fc1_output_high_precision: fmt "bf16" only: keep the FC1 output `[g; u]` unrounded
            into SwiGLU, as a fused bf16 kernel does (fp32 accumulators feed SwiGLU: the sm90
            bf16 pull kernel and its drop's `mega_reference_bf16`); the other formats
            always do.
    """
    before_fc2 = either_name(
        "oracle_forward",
        "apply_routing_weights_before_fc2",
        apply_routing_weights_before_fc2,
        "topk_weight_before_fc2",
        topk_weight_before_fc2,
        default=False,
        deprecated=True,
    )
    if fc1_output_high_precision is not False and (
        fc1_output_high_precision is not True or fmt != "bf16"
    ):
        raise MoeEpUsageError(
            f"fc1_output_high_precision={fc1_output_high_precision!r} applies to fmt='bf16' "
            f"only (a bool), got fmt={fmt!r} (the other formats never round the FC1 output)"
        )
    if type(fc2_act_block) is not int or fc2_act_block not in quant.FP8_FC2_ACT_BLOCKS:
        raise MoeEpUsageError(
            f"fc2_act_block must be one of {quant.FP8_FC2_ACT_BLOCKS}, got {fc2_act_block!r}"
        )
    if fc2_act_block != 128 and fmt != "fp8":
        raise MoeEpUsageError(
            f"fc2_act_block={fc2_act_block} applies to fmt='fp8' only, got fmt={fmt!r} "
            "(the other formats' FC2-input blocks are fixed)"
        )
    b = fc1_gate_up_interleave
    if b is not None and (type(b) is not int or b not in quant.GATE_UP_BLOCKS):
        raise MoeEpUsageError(
            f"fc1_gate_up_interleave must be None or one of {quant.GATE_UP_BLOCKS}, got {b!r}"
        )
    t, hdim = (int(s) for s in hidden_states.shape)
    e, two_i, _ = (int(s) for s in w13.shape)
    inter = two_i // 2
    xq = _qdq_act(hidden_states, fmt, act_global_scale)
    if b is None:
        w13q, gs13 = _qdq_weight(w13, fmt)
    else:
        w13q, gs13 = _qdq_weight(quant.interleave_gate_up(w13, b), fmt)
        w13q = quant.deinterleave_gate_up(w13q, b)
    w2q, gs2 = _qdq_weight(w2, fmt)
    ids = topk_ids.long()
    wts = topk_weights.double()
    exact = torch.zeros((t, hdim), dtype=torch.float64)
    terms = torch.zeros((t, hdim), dtype=torch.float64)
    y_all = torch.zeros((t, ids.shape[1], hdim), dtype=torch.float64)
    flip_all = torch.zeros((t, ids.shape[1], hdim), dtype=torch.float64)
    for ex in range(e):
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = xq[tok] @ w13q[ex].t()
        if gs13 is not None:
            gu = gu / (act_global_scale * gs13[ex])
        if fmt == "bf16" and not fc1_output_high_precision:  # as unfused bf16 MoE does
            gu = gu.to(torch.bfloat16).double()
        g, u = gu[:, :inter], gu[:, inter:]
        if swiglu_clamp is not None:
            g = g.clamp(max=swiglu_clamp)
            u = u.clamp(-swiglu_clamp, swiglu_clamp)
        h = F.silu(g) * u
        if before_fc2:
            h = h * wts[tok, slot][:, None]
        hq = _qdq_act(h.float(), fmt, hidden_global_scale, fc2_act_block, fc2=True)
        y = hq @ w2q[ex].t()
        scale2 = 1.0 if gs2 is None else 1.0 / float(hidden_global_scale * gs2[ex])
        y_all[tok, slot] = y * scale2
        step = (hq.abs() + h.abs()).float() * _ACT_REL_STEP[fmt]
        aw2 = w2q[ex].abs().float()
        flip = torch.empty((tok.numel(), hdim), dtype=torch.float32)
        for c in range(0, tok.numel(), _FLIP_CHUNK):
            flip[c : c + _FLIP_CHUNK] = (aw2 * step[c : c + _FLIP_CHUNK, None, :]).amax(dim=-1)
        flip_all[tok, slot] = flip.double() * scale2
    flips = torch.zeros((t, hdim), dtype=torch.float64)
    weight = torch.ones_like(wts) if before_fc2 else wts  # applied already
    for j in range(ids.shape[1]):
        term = weight[:, j : j + 1] * y_all[:, j]
        exact += term
        terms += term.abs()
        flips += weight[:, j : j + 1].abs() * flip_all[:, j]
    return OracleResult(exact.to(torch.bfloat16), exact, terms, flips, fmt)


def tolerance_band(
    reference: OracleResult, *, ulps: float = DEFAULT_ULPS, atol: float = DEFAULT_ATOL
) -> torch.Tensor:
    """Per cell: `ulps * 2**-7 * sum_k |w_k * y_k| + flip + atol`.

    The first term is a few bf16 ulps of the magnitude of the terms summed. `flip` allows
    one requantization flip of the FC2 input per (token, slot): a kernel whose FC1
    accumulates in another order can round one element h_i of the SwiGLU output to the
    neighbouring grid point, moving the cell by up to `|w_k| * max_i |w2_ji| * step_i`
    (step_i = the format's relative grid spacing times |h_i| + |hq_i|: 2**-7 bf16, 2**-3
    e4m3, 1 for e2m1). Without this a single flip in an fp8 / fp4 format exceeds any
    few-ulp band on cells whose y cancels.
    """
    return reference.terms * (ulps * EPS_BF16) + reference.flip + atol


def global_bound(fmt: str) -> float:
    """The most `||out - exact||_F / ||exact||_F` of a correct kernel in format `fmt`.

    `2**-8 + q / 4` (docs/layer.md derives it). 2**-8, the largest relative error of one
    bf16 rounding, covers the result's own bf16 roundings (FC2 output per (token, slot),
    weighted partial, final sum: expected `grid_rel_error(7)` = 1.5e-3 each, 2.7e-3 for
    three). q = `grid_rel_error` of the FC2 input's element format is the expected error of
    its requantization, i.e. what skipping it costs; q / 4 is what rounding a fraction
    f = 1/192 of its elements to the other neighbour costs (`sqrt(12 f) * q`: a flip moves
    an element by a whole step, a rounding by RMS step / sqrt(12)).
    """
    if fmt not in _ACT_MANTISSA_BITS:
        raise MoeEpUsageError(f"format must be one of {FORMATS}, got {fmt!r}")
    return 2.0**-8 + grid_rel_error(_ACT_MANTISSA_BITS[fmt]) / 4


def grid_rel_error(mantissa_bits: int) -> float:
    """Expected relative (Frobenius) error of round-to-nearest onto a float grid with
    `mantissa_bits` stored mantissa bits: the step is `u = 2**-mantissa_bits` of the binade,
    the error uniform over a step (RMS `u / sqrt(12)`), the mantissa m log-uniform in [1, 2)
    (`E[m**2] = 3 / (2 ln 2)`): `u / sqrt(12 * E[m**2]) = u / sqrt(18 / ln 2) ~ 0.196 u`."""
    return 2.0**-mantissa_bits / math.sqrt(18.0 / math.log(2.0))


@dataclass(frozen=True)
class ToleranceReport:
    """Per-cell band: max_ratio: max over cells of |out - exact| / band (<= 1 passes); worst:
    (row, col); violations: cells with ratio > 1; got / want / band: values at the worst cell.

    Global: rel_err: `||out - exact||_F / ||exact||_F` (<= rel_bound passes); slope: the
    least-squares slope of out against exact, `<out, exact> / <exact, exact>` (`|slope - 1|
    <= slope_bound` passes). `ok` needs both the band and the global check.
    """

    max_ratio: float
    worst: tuple[int, int]
    violations: int
    got: float
    want: float
    band: float
    rel_err: float
    rel_bound: float
    slope: float
    slope_bound: float

    @property
    def band_ok(self) -> bool:
        return self.max_ratio <= 1.0

    @property
    def global_ok(self) -> bool:
        return self.rel_err <= self.rel_bound and abs(self.slope - 1.0) <= self.slope_bound

    @property
    def ok(self) -> bool:
        return self.band_ok and self.global_ok

    def __str__(self) -> str:
        r, c = self.worst
        return (
            f"max err/band = {self.max_ratio:.3g} at [{r}, {c}] (got {self.got:.6g}, want "
            f"{self.want:.6g}, band {self.band:.3g}); {self.violations} cell(s) over the band; "
            f"||err||/||exact|| = {self.rel_err:.3g} (bound {self.rel_bound:.3g}); slope "
            f"{self.slope:.6g} (bound 1 +- {self.slope_bound:.3g})"
        )


def compare_to_oracle(
    output: torch.Tensor,
    reference: OracleResult,
    *,
    ulps: float = DEFAULT_ULPS,
    atol: float = DEFAULT_ATOL,
) -> ToleranceReport:
    """Compare a kernel's `[T, H]` output with the oracle: cell by cell against the band,
    and globally (relative Frobenius error and slope against `global_bound(reference.fmt)`).

    The slope bound is `global_bound / min(4, sqrt(n))` for n nonzero exact cells: by
    Cauchy-Schwarz `|slope - 1| <= rel_err` always; a correct kernel's errors are unbiased
    (round to nearest, flips either way), so their projection on exact shrinks like
    `1 / sqrt(n)`, of which only a factor 4 is taken.

    NaN: a cell the oracle predicts NaN (a token with NaN / inf activations) agrees only
    with NaN, and leaves the band and the global check; any other mismatch of NaN (or an
    inf) counts as an infinite error and fails.
    """
    if tuple(output.shape) != tuple(reference.exact.shape):
        raise MoeEpUsageError(
            f"output shape {tuple(output.shape)} != oracle shape {tuple(reference.exact.shape)}"
        )
    rel_bound = global_bound(reference.fmt)
    got = output.detach().cpu().double()
    if got.numel() == 0:
        return ToleranceReport(0.0, (0, 0), 0, 0.0, 0.0, 0.0, 0.0, rel_bound, 1.0, rel_bound)
    predicted_nan = torch.isnan(reference.exact)
    agree = predicted_nan & torch.isnan(got)
    exact = reference.exact.masked_fill(predicted_nan, 0.0)
    inf = torch.full_like(got, math.inf)
    err = (got.masked_fill(agree, 0.0) - exact).abs()
    err = torch.where(torch.isnan(err) | (predicted_nan & ~agree), inf, err)
    band = tolerance_band(reference, ulps=ulps, atol=atol).masked_fill(predicted_nan, 1.0)
    ratio = err / band
    flat = int(torch.argmax(ratio))
    r, c = divmod(flat, int(ratio.shape[1]))
    rel_err, slope = _global_stats(
        got.masked_fill(predicted_nan, 0.0), exact, float(torch.linalg.vector_norm(err))
    )
    nonzero = int(torch.count_nonzero(exact))
    return ToleranceReport(
        max_ratio=float(ratio.view(-1)[flat]),
        worst=(r, c),
        violations=int((ratio > 1).sum()),
        got=float(got[r, c]),
        want=float(reference.exact[r, c]),
        band=float(band[r, c]),
        rel_err=rel_err,
        rel_bound=rel_bound,
        slope=slope,
        slope_bound=rel_bound / min(4.0, math.sqrt(max(nonzero, 1))),
    )


def _global_stats(got: torch.Tensor, exact: torch.Tensor, err_norm: float) -> tuple[float, float]:
    """(relative Frobenius error, least-squares slope); an all-zero exact value gives (0, 1)
    for an all-zero output and (inf, nan) otherwise, which fail."""
    norm2 = float((exact * exact).sum())
    if norm2 == 0.0:
        return (0.0, 1.0) if err_norm == 0.0 else (math.inf, math.nan)
    return err_norm / math.sqrt(norm2), float((got * exact).sum()) / norm2

"""Expert compute, one expert at a time: gather -> FC1 -> SwiGLU -> requantize -> FC2.

Each expert's rows go through in blocks of at most `ROW_BLOCK` rows: gather into a small
workspace, `mm` against the expert's weights, SwiGLU in fp32 on cache-sized row slices, `mm`
straight into the caller's output rows. Nothing of size `[pairs, 2I]` or `[pairs, I]` is
ever materialised, so the per-pair data makes one trip through memory per stage instead of
several fp32 round-trips, and the workspace stays small and warm across forwards.

On CPU a per-expert `mm` loop measured faster than `torch._grouped_mm` (which also loops
over groups on CPU): FC1 136 vs 170 ms, FC2 63 vs 97 ms at 1 thread on the prefill shape.
On CUDA, bf16 weights without per-expert alphas go through `torch._grouped_mm` with int32
offsets instead (`grouped_mm_applies`): all local experts' rows in two grouped GEMMs, SwiGLU
in one pass between them. That branch has never run on a GPU; the CPU tests force it
(`torch._grouped_mm` runs on CPU too) and compare it with the per-expert loop.

Determinism: an expert's blocks, their GEMMs and the SwiGLU slices depend only on that
expert's rows (the same matrix, in global (token, slot) order, at every world size), so the
bf16 result is bit-identical across world sizes. At 2+ intra-op threads on CPU (with the
fused library) the blocks are spread over threads that each run one OpenMP thread, so
every GEMM is a one-thread GEMM and the result does not depend on the thread count either;
otherwise it needs the same thread count (oneDNN may split K across threads for large K).

"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F

from moe_ep.backends.portable import cpu_fused
from moe_ep.backends.portable.comm import Workspace
from moe_ep.backends.portable.configs import check_positive_float
from moe_ep.backends.portable.prepare_finalize import Dispatched
from moe_ep.backends.portable.recipes import PreparedWeights, Recipe, check_recipe
from moe_ep.errors import MoeEpUsageError

Requantize = Callable[[torch.Tensor, torch.Tensor], None]
"""`requantize(h, out)`: the FC2 input's quantization of fp32 `h`, written into out
(`Recipe.requantize_into`)."""

__all__ = [
    "ROW_BLOCK",
    "SWIGLU_ROWS",
    "TorchExperts",
    "amx_for_quantized",
    "block_scaled_operands",
    "expert_gemm_rows",
    "expert_gemm_unavailable",
    "grouped_mm_applies",
    "packs_by_default",
    "prepack",
    "prepack_host_unavailable",
    "prepack_layout",
    "prepack_unavailable",
    "run_experts",
]

ROW_BLOCK = 2048
"""Rows per GEMM call: bounds the workspace when routing is skewed."""
WIDEN_COLS = 256
"""Output columns per fp32 block of `_mm_widened` (256 x K fp32 weights, 2 MiB at K = 2048,
stay in cache for the block's GEMM): measured 1 thread, AVX2 box, 8 experts N = K = 2048,
64 / 128 / 512 rows per expert: 69.6 / 139 / 545 ms against 89.0 / 164 / 581 ms widening a
whole expert at once and 97.1 / 228 / 992 ms on the fused expert GEMM (64: 76.6 / 155 /
596, 128: 69.4 / 150 / 575; docs/layer.md)."""
SWIGLU_ROWS = 128
"""Rows per SwiGLU slice: the fp32 temporary (128 x 2I x 4 bytes) stays in L2."""
EXPERT_GEMM_ROWS_BF16 = 64
"""bf16 experts with at most this many rows run `cpu_fused.expert_gemm` where torch has no
oneDNN bf16 kernels (this CPU lacks AVX-512 BF16 / AMX; the `mm` blocks then run in fp32 on
widened weights, `_mm_widened`): measured (AMD EPYC AVX2, 2 threads, `layer_speed.py
--sections crossover`) the expert GEMM 3.0-4.0x faster at 1-8 rows, 1.46x at 16, 1.14x at
32, level at 64 (0.99x) and 0.60-0.72x from 128 (docs/layer.md)."""
EXPERT_GEMM_ROWS_BF16_KSEQ = 256
"""The same where the expert GEMM's default for bf16 is the AVX2 k-order body from
`cpu_fused.KSEQ_ROWS` rows (AVX2 CPUs without AVX-512F; the `mm` blocks widen as above):
measured (AMD EPYC AVX2, 4 experts H=2048 I=1024, `run_experts` both ways) at 2 threads the
expert GEMM 2.3-2.7x faster at 8-16 rows, 1.78x at 32, 1.24-1.29x at 64-96, 1.03-1.08x at
128-256, 0.89-0.96x from 384; at 1 thread 1.19x at 64, 0.84-1.00x at 128-256 (docs/layer.md).
Kept with the weights packed for the k order (`cpu_prepacked_weights`; on Zen 3, 2 threads,
the packed expert GEMM 1.17-1.23x faster than the `mm` blocks at 128-256 rows, 1.06x at
512, 1.02x at 1024): packing then moves the bits of experts of 1-12 rows only."""
EXPERT_GEMM_ROWS_BF16_ONEDNN = 16
"""The same where torch runs bf16 GEMMs on oneDNN's bf16 kernels and the CPU has no AMX
(else `EXPERT_GEMM_ROWS_BF16_AMX`): measured on AMD EPYC with
AVX-512 BF16 (2 threads, `layer_speed.py --sections crossover`, three runs): the expert GEMM
1.3-2.6x faster than the `mm` blocks at 1-8 rows per expert, 0.76-1.61x at 16, 0.60-0.87x at
32 and slower from there; decode T=64 (8 rows per expert on average) ran 39 ms with 16, 47
ms with 8 (docs/layer.md)."""
EXPERT_GEMM_ROWS_BF16_AMX = 96
"""The same where the expert GEMM's default for bf16 is the AMX body (`cpu_fused.
amx_by_default`): measured on an Intel Xeon with AMX (2 threads, layers A/B in one process,
2026-12-06, E=64 k=8 H=2048 I=768, against the crossover 16 the oneDNN rule gave): T=128
(about 8-25 rows per expert) 1.26x, T=256 (20-46) 1.34x, T=512 (52-81) 1.08x, T=1024 1.17x
faster with 64; 32 gained less (1.27 / 1.13 / 1.01 / 0.99x), 128 no more (1.28 / 1.35 /
1.00 / 0.93x). Since the AMX body packs its x blocks and unpacks its sums by in-register
transposes (fourth session, same day), 96 against 64: T=512 1.07 / 1.07 / 1.05x faster
(medians of 9-11, three runs), T=1024 1.10x, T=256 level, prefill (about 1024 rows per
expert) still faster on the `mm` blocks (all rows on the AMX body 1.08x slower)."""
EXPERT_GEMM_ROWS_FP32_AMX_CPU = 16
"""Quantized formats on CPUs with AMX (the expert GEMM's fp32 order on the AVX-512F body,
the `mm` blocks oneDNN's fp32 GEMMs): measured on that Intel Xeon (mxfp8, layers A/B in one
process, 2026-12-06): 16 against 64 at T=256 1.17x, T=512 1.43x faster, T=64 level; 32
1.13x / 1.40x. Other CPUs keep `EXPERT_GEMM_ROWS_FP32` (measured on AMD Zen 3 and Zen 5;
Intel CPUs with AVX-512 but no AMX not measured)."""
EXPERT_GEMM_ROWS_FP32 = 64
"""Quantized formats (fp32 GEMMs on the dequantized weights otherwise): experts with at most
this many rows run `cpu_fused.expert_gemm` on the codes and scales; measured (mxfp8, 2
threads, AVX2 body) 1.1-2.4x faster than the fp32 `mm` blocks from 8 to 64 rows, slower
from 128; again on 2026-12-03 (medians of 7): 1.75x at 16, 1.30x at 32, 1.12x at 48,
0.95x at 64, 0.88x at 96. The same with the AVX-512F body (AMD EPYC Zen 5, 2026-12-04; it
had been 1024 from a sweep on 2026-12-02): layers A/B in one process, crossover 64 against
1024, mxfp8 T=1024 (98-149 rows per expert) 1.28x, prefill (983-1084) 1.30x, fp8 / nvfp4
prefill 1.26x / 1.19x (at 128) faster, T=512 (52-81) 1.10x, T=256 (20-46) level; 32 not
better (T=512 1.05x, T=256 0.94x)."""


def _mm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ws: Workspace, name: str) -> None:
    """`out [b, N] = a [b, K] @ w [K, N]`, `w` a transposed view of K-major `[N, K]`."""
    cpu_bf16 = a.device.type == "cpu" and a.dtype == torch.bfloat16
    if cpu_bf16 and w.dtype == torch.bfloat16 and not _onednn_bf16():
        _mm_widened(a, w, out, ws, name)
    else:
        # No `(w @ x^T)^T` form for few rows: with oneDNN's bf16 GEMMs it measured 1.0-2.7x
        # slower at 17-250 rows, ragged counts worst (docs/layer.md), for the same bits.
        torch.mm(a, w, out=out)


def unsort_rows(y_sorted: torch.Tensor, order: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`out[order[i]] = y_sorted[i]`: rows sorted by `order` (a permutation) back in place, as
    a gather by the inverse permutation (4-5x faster on CPU than the scatter `index_copy_`,
    whose rows are copied element by element; no host sync)."""
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(int(order.shape[0]), device=order.device, dtype=order.dtype)
    )
    return torch.index_select(y_sorted, 0, inverse, out=out)


PACKED_MIN_ROWS = 2
"""`mm` blocks of at least this many rows use the prepacked weights: a 1-row block through
them can give other bits than `torch.mm` (seen at K = 2048, N = 1536), from 2 rows on they
matched at every shape tried at one intra-op thread (tests/layer/test_prepacked_weights.py;
at two, AMX kernels split them differently)."""


PrepackLayout = Literal["onednn", "k16"]


def prepack_layout(device: torch.device) -> PrepackLayout | None:
    """What `PortableConfig.cpu_prepacked_weights` keeps on `device`: "onednn" (oneDNN's
    blocked layout for the `mm` blocks, where torch has oneDNN's bf16 GEMMs), "k16" (the
    expert GEMM's k order on `cpu_fused.pack_k16`'s layout), or None where it cannot apply
    (`prepack_host_unavailable` says why)."""
    if prepack_host_unavailable(device) is not None:
        return None
    return "onednn" if _onednn_bf16() else "k16"


def prepack_host_unavailable(device: torch.device) -> str | None:
    """Why `PortableConfig.cpu_prepacked_weights` cannot apply on `device` whatever the
    weights, or None when it can (bf16 weights still needed: `prepack_unavailable`): where
    torch has oneDNN's bf16 GEMMs their blocked layout, else the expert GEMM's k order on
    packed weights, which needs the fused library's AVX2 k-order body as the default
    (`cpu_fused.kseq_by_default`: AVX2 and no AVX-512F)."""
    if device.type != "cpu":
        return f"the device is {device}, not the CPU"
    if not _onednn_bf16() and not cpu_fused.kseq_by_default():
        return (
            "torch has no oneDNN bf16 GEMMs on this CPU and the fused CPU library's AVX2 k "
            f"order is not its default here (vector bodies {cpu_fused.vector_bodies():#x}: "
            "it needs AVX2 without AVX-512F)"
        )
    return None


def prepack_unavailable(weights: PreparedWeights, device: torch.device) -> str | None:
    """Why `PortableConfig.cpu_prepacked_weights` cannot apply to these weights here, or
    None when it can."""
    layout = prepack_layout(device)
    if layout is None:
        return prepack_host_unavailable(device)
    if layout == "k16":  # a copy of the weights the expert GEMM reads: bf16, or e4m3 codes
        why = expert_gemm_unavailable(weights, device)
        if why is not None:
            return why
        for name, s in (("FC1", weights.stored13), ("FC2", weights.stored2)):
            if s is not None and not cpu_fused.exact_in_bf16(s):
                why = cpu_fused.codes_unpackable(s)
                if why is not None:
                    return (
                        f"the {name} weights' values are not exact in bf16 (the packed values' "
                        f"width) and their codes do not pack: {why}"
                    )
        return None
    dtypes = (weights.fc1_dtype, weights.compute_dtype)
    if dtypes != (torch.bfloat16, torch.bfloat16):
        return f"the FC1 / FC2 weights are {dtypes[0]} / {dtypes[1]}, not bf16"
    return None


def packs_by_default(weights: PreparedWeights, device: torch.device, gemm_rows: int | None) -> bool:
    """Whether `PortableConfig.cpu_prepacked_weights=None` packs these weights here: where
    the packed copy is the k order's (`prepack_layout` "k16"), which replaces the layer's
    own weights, and those hold an fp32 FC1 (the quantized formats' dequantized values,
    bf16's with `fc1_output_high_precision`: at least 4 bytes per FC1 weight, where the
    packed FC1 and FC2 together take 2 per weight, FC1 being twice FC2), the expert GEMM
    runs (`gemm_rows` not 0) and nothing refuses it (`prepack_unavailable`)."""
    return (
        gemm_rows != 0
        and weights.fc1_dtype == torch.float32
        and prepack_layout(device) == "k16"
        and prepack_unavailable(weights, device) is None
    )


def prepack(weights: PreparedWeights) -> PreparedWeights:
    """`weights` with each local expert's FC1 and FC2 weights also in oneDNN's blocked
    layout (a copy: the `mm` blocks then skip oneDNN's reorder of the weight per call), or,
    where torch has no oneDNN bf16 GEMMs, the weights' values (bf16, or a quantized format's
    dequantized weights where they are exact in bf16) packed in bf16 for the expert GEMM's
    k order instead of `w13t` / `w2t` (`cpu_fused.pack_k16`; every expert at or under the
    crossover then sums in the k order, 1.2-1.8x faster than the unpacked bodies on an AVX2
    CPU, the `mm` blocks widen from it, `_mm_k16`). Check `prepack_unavailable` first."""
    w13t, w2t = weights.w13t, weights.w2t
    assert w13t is not None and w2t is not None, "prepack: the weights are packed already"
    if not _onednn_bf16():  # prepack_layout: "k16"; w13t / w2t are [E, K, N] views
        return dataclasses.replace(  # the copy replaces them: the `mm` blocks widen from it
            weights,
            w13t=None,
            w2t=None,
            stored13=None,
            stored2=None,
            kpack13=_pack_k16(w13t, weights.stored13),
            kpack2=_pack_k16(w2t, weights.stored2),
        )

    def packed(wt: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # wt[e] is [K, N]: the GEMM's weight is its [N, K] K-major storage
        return tuple(torch.ops.mkldnn._reorder_linear_weight(w.t(), ROW_BLOCK) for w in wt)

    return dataclasses.replace(weights, packed13=packed(w13t), packed2=packed(w2t))


def _pack_k16(wt: torch.Tensor, stored: cpu_fused.StoredWeight | None) -> cpu_fused.PackedK16:
    """The k order's copy of one weight (`wt [E, K, N]`, its codes `stored`): bf16 values
    where they are exact in bf16, else the codes (`prepack_unavailable` checked they pack)."""
    if stored is not None and not cpu_fused.exact_in_bf16(stored):
        return cpu_fused.pack_k16_codes(stored)
    return cpu_fused.pack_k16(wt.transpose(1, 2))


def _mm_packed(a: torch.Tensor, packed: torch.Tensor, out: torch.Tensor) -> None:
    """`out = a @ w` for `packed` = `prepack`'s form of `w`: the same bits as `torch.mm`."""
    out.copy_(torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))


def _block_mm(
    a: torch.Tensor,
    weights: PreparedWeights,
    fc: Literal[1, 2],
    e: int,
    out: torch.Tensor,
    ws: Workspace,
) -> None:
    """`out = a @ w[e]` for FC1's or FC2's weights `w`: on expert e's prepacked weight
    (oneDNN's layout) from `PACKED_MIN_ROWS` rows, on the k order's copy where it replaces
    the weights (`_mm_k16`), else `_mm`."""
    wt, packed, kpack = (
        (weights.w13t, weights.packed13, weights.kpack13)
        if fc == 1
        else (weights.w2t, weights.packed2, weights.kpack2)
    )
    name = f"fc{fc}_t"
    if wt is None:
        assert kpack is not None
        _mm_k16(a, kpack, e, out, ws, name)
    elif packed is not None and int(a.shape[0]) >= PACKED_MIN_ROWS:
        _mm_packed(a, packed[e], out)
    else:
        _mm(a, wt[e], out, ws, name)


def _mm_k16(
    a: torch.Tensor,
    kpack: cpu_fused.PackedK16,
    e: int,
    out: torch.Tensor,
    ws: Workspace,
    name: str,
) -> None:
    """`out [b, N] = a [b, K] @ w_e^T` from expert e's weights packed for the k order alone
    (`cpu_fused.pack_k16`'s layout), as `_mm_widened`: its column blocks widened from the
    packed 16-column blocks, so the same fp32 GEMMs on the same values (the same bits as
    the unpacked weights' `mm` blocks, tested)."""
    _mm_column_blocks(a, kpack.n, functools.partial(kpack.widen, e), out, ws, name)


def _mm_widened(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, ws: Workspace, name: str
) -> None:
    """`_mm` for bf16 `a` and `w` on a CPU where torch has no oneDNN bf16 GEMMs (its bf16
    fallback is 4-5x slower than its fp32 GEMM there): `_mm_column_blocks` on `w`'s
    columns: fp32 accumulation of exact bf16 products, as the bf16 GEMM."""
    rows = w.t()  # [N, K], K-major: a block of columns is a block of contiguous rows

    def fill(j: int, m: int, w32: torch.Tensor) -> None:
        w32[:m].copy_(rows[j : j + m])

    _mm_column_blocks(a, int(w.shape[1]), fill, out, ws, name)


def _mm_column_blocks(
    a: torch.Tensor,
    n: int,
    fill: Callable[[int, int, torch.Tensor], None],
    out: torch.Tensor,
    ws: Workspace,
    name: str,
) -> None:
    """`out [b, n] = a [b, K] @ W^T`: `a` widened to fp32 where bf16 (exact), and `WIDEN_COLS`
    output columns of W at a time widened by `fill(j, m, w32)` (W's rows j to j + m, fp32
    K-major, into `w32`'s first m rows; it may write up to the next multiple of 16) into a
    cache-sized buffer, fp32 `mm`, each block rounded into `out` (RNE where bf16)."""
    b, k = int(a.shape[0]), int(a.shape[1])
    nb = min(n, WIDEN_COLS)
    a32 = a if a.dtype == torch.float32 else ws.get(f"{name}_a32", (b, k), torch.float32, a.device)
    if a32 is not a:
        a32.copy_(a)
    w32 = ws.get(f"{name}_w32", (-(-nb // 16) * 16, k), torch.float32, a.device)
    o32 = ws.get(f"{name}_o32", (b * nb,), torch.float32, a.device)
    for j in range(0, n, nb):
        m = min(nb, n - j)
        o = o32[: b * m].view(b, m)
        fill(j, m, w32)
        torch.mm(a32, w32[:m].t(), out=o)
        out[:, j : j + m].copy_(o)


def _swiglu(
    gu: torch.Tensor,
    h: torch.Tensor,
    alpha: float | None,
    clamp: float | None,
    requantize: Requantize | None,
    ws: Workspace,
    row_scale: torch.Tensor | None = None,
) -> None:
    """`gu [b, 2I]` -> `h [b, I]`: `requantize(silu(g) * u)` in fp32, written into h.

    row_scale: `[b]` fp32, multiplies each row of `silu(g) * u` before `requantize` (the
    top-k weight applied before FC2).

    `requantize=None`: the rounding into h is the whole quantization (one fp32 multiply,
    one rounding). bf16 on CPU with `requantize=None` goes through `cpu_fused.swiglu` (one
    pass) when its library is available.
    """
    if requantize is None and row_scale is None and cpu_fused.swiglu(gu, h, alpha, clamp):
        return
    b, inter = int(h.shape[0]), int(h.shape[1])
    rows = b if gu.device.type == "cuda" else min(b, SWIGLU_ROWS)  # CPU: cache-sized slices
    in_place = gu.dtype == torch.float32  # fp32 GEMM output: work on it directly
    if not in_place:
        buf = ws.get("swiglu_gu", (rows, 2 * inter), torch.float32, gu.device)
    for s in range(0, b, rows):
        e = min(b, s + rows)
        if in_place:
            part = gu[s:e]
        else:
            part = buf[: e - s]
            part.copy_(gu[s:e])  # widen g and u in one pass
        g, u = part[:, :inter], part[:, inter:]
        if alpha is not None:
            part.mul_(alpha)  # g and u
        if clamp is not None:
            g.clamp_(max=clamp)
            u.clamp_(-clamp, clamp)
        F.silu(g, inplace=True)
        if requantize is None and row_scale is None and h.dtype == g.dtype:
            torch.mul(g, u, out=h[s:e])
        else:
            g.mul_(u)  # h = silu(g) * u in fp32
            if row_scale is not None:
                g.mul_(row_scale[s:e, None])
            # copy_ rounds to h's dtype (RNE) where needed; an fp32 mul with a bf16 `out`
            # measured 2x slower than this in-place mul plus a rounding copy (same bits).
            # requantize writes h itself (one fused pass on CPU where the format has one).
            if requantize is None:
                h[s:e].copy_(g)
            else:
                requantize(g, h[s:e])


def expert_gemm_unavailable(weights: PreparedWeights, device: torch.device) -> str | None:
    """Why the CPU expert GEMM cannot run on these weights here, or None when it can."""
    if device.type != "cpu":
        return f"the device is {device}, not the CPU"
    packed = weights.kpack13 is not None and weights.kpack2 is not None
    if not packed and (weights.stored13 is None or weights.stored2 is None):
        return "the prepared weights have no stored (CPU) form"
    if cpu_fused.library() is None:
        return f"the fused CPU library is not loaded ({cpu_fused.status()[1]})"
    return None


def expert_gemm_rows(weights: PreparedWeights, device: torch.device) -> int:
    """The default crossover: experts with at most this many rows (0: none) in a forward run
    the CPU expert GEMM (`cpu_fused.expert_gemm`, weights read once in their stored width),
    the rest the `mm` blocks. Needs the CPU, the fused library and the stored weights. The
    choice depends only on the expert's row count, which is the same at every world size;
    `PortableConfig.expert_gemm_rows` replaces it."""
    if expert_gemm_unavailable(weights, device) is not None:
        return 0
    if weights.kpack13 is not None:  # every format on the packed bf16 copy: bf16's crossover
        return EXPERT_GEMM_ROWS_BF16_KSEQ
    assert weights.stored13 is not None
    amx = cpu_fused.amx_by_default()
    if weights.stored13.code != "bf16":
        return EXPERT_GEMM_ROWS_FP32_AMX_CPU if amx else EXPERT_GEMM_ROWS_FP32
    if amx:
        return EXPERT_GEMM_ROWS_BF16_AMX
    if _onednn_bf16():
        return EXPERT_GEMM_ROWS_BF16_ONEDNN
    return EXPERT_GEMM_ROWS_BF16_KSEQ if cpu_fused.kseq_by_default() else EXPERT_GEMM_ROWS_BF16


@functools.cache
def _onednn_bf16() -> bool:
    """Whether torch runs CPU bf16 GEMMs on oneDNN's bf16 kernels (else its slow fallback)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _segments(
    experts: list[int], starts: list[int], counts: list[int], most: int
) -> Iterator[list[tuple[int, int, int]]]:
    """The experts' (expert, first pair, rows) runs in batches of at most `most` rows (an
    expert with more is split into consecutive runs: rows are independent)."""
    batch: list[tuple[int, int, int]] = []
    size = 0
    for e in experts:
        for s in range(starts[e], starts[e] + counts[e], most):
            b = min(most, starts[e] + counts[e] - s)
            if size + b > most:
                yield batch
                batch, size = [], 0
            batch.append((e, s, b))
            size += b
    if batch:
        yield batch


def _run_expert_gemm(
    rows: torch.Tensor,
    src_row: torch.Tensor,
    runs: list[tuple[int, int, int]],
    weights: PreparedWeights,
    requantize: Requantize | None,
    swiglu_clamp: float | None,
    y: torch.Tensor,
    ws: Workspace,
    pair_scale: torch.Tensor | None,
    path: list[int],
    vector: bool | cpu_fused.Body = True,
    codes: _BlockScaled | None = None,
) -> None:
    """FC1, SwiGLU and FC2 of the (expert, first pair, rows) runs, all experts in one
    `cpu_fused.expert_gemm` call per GEMM (the threads split experts and output tiles) on
    body `vector`; `path[e]`: the row count that picks expert e's vector body. `codes`:
    both GEMMs in the block-scaled AMX order, FC1 on the rows' codes, FC2 on the SwiGLU
    output's (`cpu_fused.quant_e4m3`, the recipe's requantization) instead of `requantize`."""
    s13, s2 = weights.stored13, weights.stored2
    # the prepacked copies (k order) where the default bodies run (they replace s13 / s2)
    p13: cpu_fused.StoredWeight | cpu_fused.PackedK16 | None = s13
    p2: cpu_fused.StoredWeight | cpu_fused.PackedK16 | None = s2
    if vector is True and weights.kpack13 is not None and weights.kpack2 is not None:
        p13, p2 = weights.kpack13, weights.kpack2
    assert p13 is not None and p2 is not None  # packed weights: vector is True
    cdt = weights.compute_dtype
    inter, k_most = p2.k, max(p13.k, p2.k)
    starts = list(itertools.accumulate((b for *_, b in runs), initial=0))
    q = starts[-1]
    # the runs' columns as one tensor (one small op per forward, not one per column)
    cols = torch.tensor(
        [starts, [*(e for e, *_ in runs), 0], [*(s for _, s, _ in runs), 0],
         [*(path[e] for e, *_ in runs), 0], [*(b for *_, b in runs), 0]],
        dtype=torch.int64,
    )  # fmt: skip
    q_start, expert, first, path_rows, lens = cols[0], *cols[1:, :-1]
    pair = torch.arange(q, dtype=torch.int64) + torch.repeat_interleave(first - q_start[:-1], lens)
    xs = ws.get("eg_scratch", cpu_fused.expert_gemm_scratch(q, k_most), torch.float32, rows.device)
    gu = ws.get("eg_gu", (q, 2 * inter), weights.fc1_dtype, rows.device)  # fp32: kept
    h = ws.get("eg_h", (q, inter), cdt, rows.device)
    a13 = None if weights.alpha13 is None else weights.alpha13[expert].contiguous()
    a2 = None if weights.alpha2 is None else weights.alpha2[expert].contiguous()
    x_rows = src_row[pair].contiguous()
    fc1 = cpu_fused.ExpertGroups(q_start, expert, q_start[:-1], path_rows)
    fc2 = cpu_fused.ExpertGroups(q_start, expert, first, path_rows)
    scale = None if pair_scale is None else pair_scale[pair]
    if codes is not None:
        assert s13 is not None and s2 is not None  # block_scaled_operands
        x = codes.rows
        cpu_fused.expert_gemm(
            x.codes, x_rows, fc1, s13, gu, xs, alpha=a13, vector="amx", x_scales=x.scales,
            x_block=x.block,
        )  # fmt: skip
        _swiglu(gu, h, None, swiglu_clamp, None, ws, scale)  # h: fp32, not yet quantized
        blk = codes.fc2.block
        hc = ws.get("eg_h_codes", (q, inter), torch.uint8, rows.device)
        hs = ws.get("eg_h_scales", (q, inter // blk), torch.float32, rows.device)
        if not cpu_fused.quant_e4m3(h, hc, hs, codes.fc2):  # block_scaled_operands checked
            raise RuntimeError(f"the fused CPU pass refused the FC2 input's codes ({codes.fc2})")
        cpu_fused.expert_gemm(
            hc, None, fc2, s2, y, xs, alpha=a2, vector="amx", x_scales=hs, x_block=blk
        )
        return
    cpu_fused.expert_gemm(rows, x_rows, fc1, p13, gu, xs, alpha=a13, vector=vector)
    # alpha13 above: the fp32 product _swiglu would take first
    _swiglu(gu, h, None, swiglu_clamp, requantize, ws, scale)
    cpu_fused.expert_gemm(h, None, fc2, p2, y, xs, alpha=a2, vector=vector)


@dataclasses.dataclass(frozen=True)
class _BlockScaled:
    """The block-scaled order's operands: the FC1 input rows' codes and the FC2 input's
    quantization (`fake_quant` spec)."""

    rows: cpu_fused.E4m3Rows
    fc2: cpu_fused.FakeQuant


def block_scaled_operands(
    weights: PreparedWeights,
    rows: torch.Tensor,
    codes: cpu_fused.E4m3Rows | None,
    fc2: cpu_fused.FakeQuant | None,
    gemm_rows: int | None,
) -> _BlockScaled | None:
    """The block-scaled order's operands where every expert runs in it: the rows' codes and
    the FC2 quantization given (`Recipe.keeps_codes`), weights the order takes
    (`cpu_fused.block_scaled_weights`), the default crossover, and the order available here
    (fp8 and the sm90 hybrids on a CPU with AMX; fp8: 2.0x / 3.3x
    faster than the fp32 order at 8 / 16 rows per expert, 64 experts N = K = 2048, kernel
    alone, 2 threads; docs/layer.md). An expert's bits then do not depend on its row
    count."""
    s13, s2 = weights.stored13, weights.stored2
    if (
        codes is None
        or fc2 is None
        or gemm_rows is not None
        or s13 is None
        or s2 is None
        or expert_gemm_unavailable(weights, rows.device) is not None
        or not cpu_fused.block_scaled_by_default()
        or fc2.kind not in cpu_fused.E4M3_CODE_KINDS
        or int(s2.k) % fc2.block
    ):
        return None
    if not all(cpu_fused.block_scaled_weights(s) for s in (s13, s2)):
        return None
    return _BlockScaled(codes, fc2)


def amx_for_quantized(weights: PreparedWeights, device: torch.device) -> bool:
    """Whether every expert runs the expert GEMM in the AMX order (with the default
    crossover): a quantized format whose operands are exact in bf16, on a CPU with AMX.
    There its 16-bit-lane code decode makes the AMX order the fastest path from 2 rows per
    expert on (mxfp8 `cpu_fused.expert_gemm` alone, 2 threads: 64 experts N = K = 2048 at 8
    rows each 28 ms against the fp32 order's 71; 16 experts at 64 / 256 rows 12 / 38 ms,
    where the fp32 `mm` blocks took about 82 / 229; docs/layer.md), level at 1, and an
    expert's bits then do not depend on its row count."""
    quantized = weights.stored13 is not None and weights.stored13.code != "bf16"
    return (
        quantized
        and weights.operands_exact_in_bf16
        and expert_gemm_unavailable(weights, device) is None
        and cpu_fused.amx_by_default()
    )


def grouped_mm_applies(weights: PreparedWeights, device: torch.device) -> bool:
    """Whether `run_experts` uses `torch._grouped_mm`: CUDA, bf16 weights (an FC1 kept in
    fp32 has fp32 w13t), no alphas, and
    the operands `torch._grouped_mm` accepts (every stride a multiple of 16 bytes, i.e. H and
    I multiples of 8, and 16-byte aligned weights); otherwise the per-expert loop runs."""
    return (
        device.type == "cuda"
        and weights.compute_dtype == torch.bfloat16
        and weights.fc1_dtype == torch.bfloat16
        and weights.alpha13 is None
        and weights.alpha2 is None
        and _grouped_mm_operands_ok(weights)
    )


def _grouped_mm_operands_ok(weights: PreparedWeights) -> bool:
    dense = (weights.w13t, weights.w2t)
    aligned = all(w is not None and w.data_ptr() % 16 == 0 for w in dense)
    return weights.hidden % 8 == 0 and weights.inter % 8 == 0 and aligned


def _run_grouped(
    rows: torch.Tensor,
    src_row: torch.Tensor,
    counts: list[int],
    weights: PreparedWeights,
    requantize: Requantize | None,
    swiglu_clamp: float | None,
    y: torch.Tensor,
    ws: Workspace,
    pair_scale: torch.Tensor | None,
) -> None:
    """`run_experts` as two `torch._grouped_mm` calls (int32 group end offsets)."""
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(rows.device)
    xs = rows.index_select(0, src_row)
    assert weights.w13t is not None and weights.w2t is not None  # grouped_mm_applies
    gu = torch._grouped_mm(xs, weights.w13t, offs=offs)
    h = torch.empty(gu.shape[0], gu.shape[1] // 2, dtype=gu.dtype, device=gu.device)
    _swiglu(gu, h, None, swiglu_clamp, requantize, ws, pair_scale)
    y.copy_(torch._grouped_mm(h, weights.w2t, offs=offs))


def run_experts(
    rows: torch.Tensor,
    src_row: torch.Tensor,
    counts: list[int],
    weights: PreparedWeights,
    requantize: Requantize | None,
    swiglu_clamp: float | None,
    y: torch.Tensor,
    ws: Workspace,
    *,
    pair_scale: torch.Tensor | None = None,
    path_counts: list[int] | None = None,
    gemm_rows: int | None = None,
    codes: cpu_fused.E4m3Rows | None = None,
    fc2_codes: cpu_fused.FakeQuant | None = None,
) -> None:
    """Write `y [P, H]` bf16, pair p's expert output, pairs grouped by local expert.

    rows: `[R, H]` compute dtype, the received (dequantized) token rows.
    src_row: `[P]` int64, the row of `rows` of each pair, pairs grouped by local expert
        (`counts[e]` pairs of expert e, in global (token, slot) order within a group).

    `[g; u] = x @ w13t`, `h = silu(g) * u` in fp32 (per-expert alpha13 applied to g and u
    first; clamp: g <= c, |u| <= c), FC2 input = `requantize(h)` (None: h itself) rounded
    to the compute dtype,
    `y = h @ w2t` (times alpha2), rounded to bf16. pair_scale: `[P]` fp32 per pair (same
    order), multiplies h before `requantize` (the top-k weight applied before FC2).
    path_counts: per expert, the row count that chooses between the expert GEMM and the
    `mm` blocks (`Dispatched.path_rows`); None: `counts`.
    gemm_rows: the crossover (`PortableConfig.expert_gemm_rows`); None: `expert_gemm_rows`.
    codes, fc2_codes: the rows' e4m3 codes and the FC2 input's quantization (`Dispatched.
        codes`, the recipe's `fake_quant`): with the default crossover, weights the order
        takes (fp8's, or the hybrids' exact in bf16) and a CPU with AMX, every expert runs
        both GEMMs in the block-scaled AMX order on the codes (`cpu_fused.expert_gemm`'s
        `x_scales`), `requantize` replaced by the same quantization into codes.

    Raises:
        MoeEpUsageError: gemm_rows > 0 where the expert GEMM cannot run.
    """
    if grouped_mm_applies(weights, rows.device):
        if sum(counts):
            _run_grouped(
                rows, src_row, counts, weights, requantize, swiglu_clamp, y, ws, pair_scale
            )
        return
    starts = list(itertools.accumulate(counts, initial=0))
    path = counts if path_counts is None else path_counts
    vector: bool | cpu_fused.Body = True
    scaled = block_scaled_operands(weights, rows, codes, fc2_codes, gemm_rows)
    if scaled is not None:
        limit = max(path, default=0)  # every expert, in the block-scaled order
    elif gemm_rows is None and amx_for_quantized(weights, rows.device):
        limit, vector = max(path, default=0), "amx"  # every expert, on AMX
    elif gemm_rows is None:
        limit = expert_gemm_rows(weights, rows.device)
    else:
        why = expert_gemm_unavailable(weights, rows.device) if gemm_rows else None
        if why is not None:
            raise MoeEpUsageError(f"expert_gemm_rows={gemm_rows}: no CPU expert GEMM here ({why})")
        limit = gemm_rows
    few = [e for e, c in enumerate(counts) if c > 0 and path[e] <= limit]
    for runs in _segments(few, starts, counts, ROW_BLOCK):
        _run_expert_gemm(
            rows, src_row, runs, weights, requantize, swiglu_clamp, y, ws, pair_scale, path,
            vector, scaled,
        )  # fmt: skip
    many = [(e, starts[e], c) for e, c in enumerate(counts) if c > 0 and path[e] > limit]
    block = min(ROW_BLOCK, max((c for *_, c in many), default=0))
    if block == 0:
        return
    # (local expert, first pair, rows): the unit of work, fixed by the routing
    tasks = [(e, s, min(block, st + c - s)) for e, st, c in many for s in range(st, st + c, block)]
    run = functools.partial(
        _run_blocks,
        rows=rows,
        src_row=src_row,
        weights=weights,
        requantize=requantize,
        swiglu_clamp=swiglu_clamp,
        y=y,
        block=block,
        pair_scale=pair_scale,
    )
    workers = cpu_fused.parallel_workers(rows.device)
    if workers == 1:
        run(tasks, ws=ws)
        return
    # Each thread runs whole blocks with one OpenMP thread: on CPU two ~1000-row GEMMs side by
    # side beat each split over two threads, and a block's bits do not depend on the intra-op
    # thread count (always one) or on which thread runs it, so neither does the output. The
    # threads take blocks from one queue, largest first, so they finish together even when
    # the routing or a busy core makes blocks unequal; even one block runs this way.
    queue = _TaskQueue(tasks)
    cpu_fused.run_single_threaded(
        [
            functools.partial(run, queue, ws=ws if i == 0 else ws.sub(f"thread{i}"))
            for i in range(min(workers, len(tasks)))
        ]
    )


class _TaskQueue:
    """Hands each (expert, first pair, rows) task to exactly one thread, largest first."""

    def __init__(self, tasks: list[tuple[int, int, int]]) -> None:
        self._left = sorted(tasks, key=lambda task: task[2])  # popped from the end
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        while True:
            with self._lock:
                if not self._left:
                    return
                task = self._left.pop()
            yield task


def _run_blocks(
    tasks: Iterable[tuple[int, int, int]],
    rows: torch.Tensor,
    src_row: torch.Tensor,
    weights: PreparedWeights,
    requantize: Requantize | None,
    swiglu_clamp: float | None,
    y: torch.Tensor,
    ws: Workspace,
    block: int,
    pair_scale: torch.Tensor | None = None,
) -> None:
    """gather -> FC1 -> SwiGLU -> FC2 for each (expert, first pair, rows) task, into y."""
    hidden, inter = weights.hidden, weights.inter
    cdt, dev = weights.compute_dtype, rows.device
    fc1_dtype = weights.fc1_dtype  # fp32 with bf16 activations: FC1's output kept in fp32
    alpha13 = None if weights.alpha13 is None else weights.alpha13.tolist()
    alpha2 = None if weights.alpha2 is None else weights.alpha2.tolist()
    direct = cdt == torch.bfloat16 and alpha2 is None  # FC2 writes y's bf16 rows itself
    xe_buf = ws.get("expert_x", (block, int(rows.shape[1])), cdt, dev)
    x1_buf = None if fc1_dtype == cdt else ws.get("expert_x1", xe_buf.shape, fc1_dtype, dev)
    gu_buf = ws.get("expert_gu", (block, 2 * inter), fc1_dtype, dev)
    h_buf = ws.get("expert_h", (block, inter), cdt, dev)
    y_buf = None if direct else ws.get("expert_y", (block, hidden), cdt, dev)
    for e, s, b in tasks:
        xe, gu, h = xe_buf[:b], gu_buf[:b], h_buf[:b]
        torch.index_select(rows, 0, src_row[s : s + b], out=xe)
        x1 = xe if x1_buf is None else x1_buf[:b].copy_(xe)  # exact: bf16 into fp32
        _block_mm(x1, weights, 1, e, gu, ws)
        a13 = None if alpha13 is None else alpha13[e]
        scale = None if pair_scale is None else pair_scale[s : s + b]
        _swiglu(gu, h, a13, swiglu_clamp, requantize, ws, scale)
        if y_buf is None:
            _block_mm(h, weights, 2, e, y[s : s + b], ws)
        else:
            ye = y_buf[:b]
            _block_mm(h, weights, 2, e, ye, ws)
            if alpha2 is not None:  # the product in fp32, then rounded to bf16
                ye = ye.mul_(alpha2[e]) if cdt == torch.float32 else ye.float() * alpha2[e]
            y[s : s + b].copy_(ye)


class TorchExperts:
    """The portable kernels' `Experts`: the pairs grouped by local expert with a stable sort
    (each expert sees its rows in the order dispatched), `run_experts`, back to pair order.

    Args:
        recipe: the format: how the FC2 input (the SwiGLU output) is requantized.
        swiglu_clamp: None, or c: the gate clamped to `<= c`, the up projection to `[-c, c]`.
        expert_gemm_rows: the experts path crossover (`run_experts`'s `gemm_rows`); None:
            the measured default.
    """

    def __init__(
        self,
        recipe: Recipe,
        swiglu_clamp: float | None = None,
        expert_gemm_rows: int | None = None,
    ) -> None:
        check_recipe(recipe)
        if swiglu_clamp is not None:
            check_positive_float("swiglu_clamp", swiglu_clamp)
        if expert_gemm_rows is not None and (
            type(expert_gemm_rows) is not int or expert_gemm_rows < 0
        ):
            raise MoeEpUsageError(
                f"expert_gemm_rows must be None or an int >= 0, got {expert_gemm_rows!r}"
            )
        self.recipe = recipe
        self.swiglu_clamp = swiglu_clamp
        self.gemm_rows = expert_gemm_rows
        self.workspace = Workspace()

    def apply(self, dispatched: Dispatched, weights: PreparedWeights) -> torch.Tensor:
        """`[P, H]` bf16, pair p's expert output at row p; valid until the next `apply`."""
        d, ws, recipe = dispatched, self.workspace, self.recipe
        dev = d.rows.device
        order = torch.sort(d.pair_expert, stable=True).indices
        counts = torch.bincount(d.pair_expert, minlength=weights.num_experts).tolist()
        shape = (int(order.numel()), weights.hidden)
        y_sorted = ws.get("y_sorted", shape, torch.bfloat16, dev)
        run_experts(
            d.rows,
            d.pair_row[order],
            counts,
            weights,
            None if recipe.requantize_is_rounding else recipe.requantize_into,
            self.swiglu_clamp,
            y_sorted,
            ws,
            pair_scale=None if d.pair_scale is None else d.pair_scale[order],
            path_counts=d.path_rows,
            gemm_rows=self.gemm_rows,
            codes=d.codes,
            fc2_codes=recipe.fake_quant,
        )
        return unsort_rows(y_sorted, order, ws.get("y_pairs", shape, torch.bfloat16, dev))

    def clear(self) -> None:
        """Drop the expert blocks' buffers (idempotent)."""
        self.workspace.clear()

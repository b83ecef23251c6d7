"""The shapes `moe-ep bench` runs: named families of (H, I, E, k) at several tokens per rank."""

from __future__ import annotations

from dataclasses import dataclass

from moe_ep.errors import MoeEpUsageError

SHAPE_KEYS = ("T", "H", "I", "E", "k")


@dataclass(frozen=True)
class BenchShape:
    """One problem: `tokens` per rank, hidden `H`, intermediate `I`, experts `E`, top-k `k`;
    `family` names the (H, I, E, k) it belongs to (one plot per family)."""

    family: str
    tokens: int
    hidden: int
    inter: int
    experts: int
    topk: int

    def text(self) -> str:
        """ "T=4096 H=2048 I=1024 E=16 k=4"."""
        return f"T={self.tokens} H={self.hidden} I={self.inter} E={self.experts} k={self.topk}"

    def dims(self) -> str:
        """The family's dimensions, "H=2048 I=1024 E=16 k=4"."""
        return self.text().split(" ", 1)[1]

    def as_dict(self) -> dict[str, object]:
        return {
            "family": self.family,
            "T": self.tokens,
            "H": self.hidden,
            "I": self.inter,
            "E": self.experts,
            "k": self.topk,
        }


def _family(
    name: str, dims: tuple[int, int, int, int], tokens: tuple[int, ...]
) -> list[BenchShape]:
    return [BenchShape(name, t, *dims) for t in tokens]


CPU_SHAPES: tuple[BenchShape, ...] = (
    # the CPU benchmarks' prefill, mid (T=512) and decode shapes (benchmarks/layer_speed.py)
    *_family("prefill", (2048, 1024, 16, 4), (1024, 4096)),
    *_family("mid", (2048, 768, 64, 8), (128, 512)),
    *_family("decode", (2048, 1024, 64, 8), (1, 4, 16, 64)),
)
DEEPSEEK_V3 = (7168, 2048, 256, 8)
"""DeepSeek-V3's routed experts: H, I, E, k."""
PEAK_PER_WEIGHT_BYTES = 8
"""Host bytes the bench may hold per expert weight at its peak (estimate): the bf16 pack (2),
a quantized kernel's fp32 dequantized copy (4), its codes and the peer's copy (about 2).
Where a quantized kernel packs for the k order (`cpu_prepacked_weights`' default on AVX2
CPUs) the packed copy (2; fp8's codes 1) replaces its fp32 copy and codes once made: about
9 for a moment at construction, within the margin of `deepseek_like`'s half of the memory."""


def deepseek_like(available_bytes: int | None) -> list[BenchShape]:
    """DeepSeek-V3's E=256 k=8 H=7168 at T=16 and 64 with I = 2048 / d, d the smallest power
    of two (1 to 64) whose weights, at `PEAK_PER_WEIGHT_BYTES` each, fit in half of
    `available_bytes` (None: unknown, d = 8: 2.6 GiB of bf16 weights, as on a 24 GiB box)."""
    h, i, e, k = DEEPSEEK_V3
    d = 8
    if available_bytes is not None:
        d = next(
            (d for d in (1, 2, 4, 8, 16, 32) if 3 * h * (i // d) * e * PEAK_PER_WEIGHT_BYTES
             <= available_bytes // 2),
            64,
        )  # fmt: skip
    name = "DeepSeek-like" if d == 1 else f"DeepSeek-like I/{d}"
    return _family(name, (h, i // d, e, k), (16, 64))


def default_shapes(available_bytes: int | None) -> tuple[BenchShape, ...]:
    """The default shapes: the CPU families and DeepSeek-like scaled to `available_bytes`."""
    return (*CPU_SHAPES, *deepseek_like(available_bytes))


QUICK_SHAPES: tuple[BenchShape, ...] = (
    BenchShape("prefill-like", 512, 1024, 512, 16, 4),
    BenchShape("decode-like", 16, 1024, 512, 32, 8),
)
"""`--quick`: one small shape per regime."""


def parse_shape(text: str) -> BenchShape:
    """ "T,H,I,E,k": five integers >= 1 with k <= E, of the family "--shape" (shapes of
    equal dims share a plot).

    Raises:
        MoeEpUsageError: names `--shape`, the value and the rule.
    """
    parts = text.split(",")
    rule = "--shape must be T,H,I,E,k: five integers >= 1 with k <= E (e.g. 4096,2048,1024,16,4)"
    if len(parts) != len(SHAPE_KEYS):
        raise MoeEpUsageError(f"{rule}, got {text!r}")
    try:
        t, h, i, e, k = (int(p) for p in parts)
    except ValueError:
        raise MoeEpUsageError(f"{rule}, got {text!r}") from None
    if min(t, h, i, e, k) < 1 or k > e:
        raise MoeEpUsageError(f"{rule}, got {text!r}")
    return BenchShape("--shape", t, h, i, e, k)

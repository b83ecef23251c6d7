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


DEFAULT_SHAPES: tuple[BenchShape, ...] = (
    # the CPU benchmarks' prefill, mid (T=512) and decode shapes (benchmarks/layer_speed.py)
    *_family("prefill", (2048, 1024, 16, 4), (1024, 4096)),
    *_family("mid", (2048, 768, 64, 8), (128, 512)),
    *_family("decode", (2048, 1024, 64, 8), (1, 4, 16, 64)),
    # DeepSeek-V3's E=256 k=8 H=7168 with I=2048 / 8: 2.6 GiB of bf16 weights, not 21 GiB
    *_family("DeepSeek-like I/8", (7168, 256, 256, 8), (16, 64)),
)
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

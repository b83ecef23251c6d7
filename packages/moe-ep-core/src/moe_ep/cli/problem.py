"""The synthetic problem of `moe-ep demo` / `moe-ep run`, built one rank's shard at a time.

Every piece is generated from its own seed, derived from `JobSpec.seed` and the piece's
index, so each rank builds only what it needs and no rank ever holds the global problem:

- rank r's tokens (`hidden_states [n, H]`, `topk_ids [n, k]`, `topk_weights [n, k]`) come
  from the seed of (seed, "tokens", r): the same at every world size;
- expert e's weights (`w13 [2I, H]`, `w2 [H, I]`, bf16) from the seed of (seed, "expert",
  e): the same at every world size and on every rank;
- the oracle of a rank's output rows needs the weights of every expert its tokens route to;
  `rank_oracle` generates them a bounded chunk at a time (`ORACLE_CHUNK_BYTES`) and adds up
  the partial references (each (token, slot) pair belongs to exactly one expert, so the
  partial sums add to the dense reference up to float64 rounding).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

from moe_ep.errors import MoeEpUsageError

if TYPE_CHECKING:
    import torch

    from moe_ep.oracle import OracleResult

__all__ = [
    "ORACLE_CHUNK_BYTES",
    "JobSpec",
    "expert_weights",
    "oracle_bytes_per_expert",
    "rank_oracle",
    "rank_tokens",
]

ORACLE_CHUNK_BYTES = 512 << 20
"""Most memory the oracle's weight chunk may take (bf16 source, fp32 steps, float64)."""


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One problem: `tokens` per rank; kernels run one after another on the same ranks."""

    kernels: tuple[str, ...]
    world_size: int
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    topk: int
    routing: str = "uniform"
    check: bool = True
    iters: int = 3
    seed: int = 0

    def validate(self) -> None:
        for name in ("world_size", "hidden", "intermediate", "experts", "topk", "iters"):
            value = getattr(self, name)
            if value < 1:
                raise MoeEpUsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.tokens < 0:
            raise MoeEpUsageError(f"--tokens must be >= 0, got {self.tokens}")
        if self.experts % self.world_size:
            raise MoeEpUsageError(
                f"--experts must be divisible by --world-size: got {self.experts} experts on "
                f"{self.world_size} ranks (e.g. --experts {self.world_size * 8})"
            )
        if self.topk > self.experts:
            raise MoeEpUsageError(f"--topk ({self.topk}) must be <= --experts ({self.experts})")
        if self.routing not in ("uniform", "skewed"):
            raise MoeEpUsageError(f"--routing must be uniform or skewed, got {self.routing!r}")

    @property
    def local_experts(self) -> int:
        return self.experts // self.world_size


def _generator(seed: int, kind: str, index: int) -> torch.Generator:
    import torch

    digest = hashlib.blake2b(f"{seed}/{kind}/{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def rank_tokens(spec: JobSpec, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tokens: `x [n, H]` bf16, `ids [n, k]` int64 (global expert ids),
    `topk_weights [n, k]` fp32 (softmax); `skewed` routing sends about 70% of the tokens to
    the last expert."""
    import torch

    g = _generator(spec.seed, "tokens", rank)
    n, e, k = spec.tokens, spec.experts, spec.topk
    x = torch.randn(n, spec.hidden, generator=g).bfloat16()
    scores = torch.rand(n, e, generator=g)
    if spec.routing == "skewed":
        scores[:, e - 1] += (torch.rand(n, generator=g) < 0.7).float()  # one hot expert
    ids = scores.topk(k, dim=1).indices
    weights = torch.softmax(torch.randn(n, k, generator=g), dim=1)
    return {"x": x, "ids": ids, "topk_weights": weights}


def expert_weights(spec: JobSpec, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`w13 [len(experts), 2I, H]` and `w2 [len(experts), H, I]` bf16 of those experts."""
    import torch

    h, i = spec.hidden, spec.intermediate
    w13 = torch.empty(len(experts), 2 * i, h, dtype=torch.bfloat16)
    w2 = torch.empty(len(experts), h, i, dtype=torch.bfloat16)
    for j, ex in enumerate(experts):
        g = _generator(spec.seed, "expert", ex)
        w13[j] = torch.randn(2 * i, h, generator=g) / h**0.5
        w2[j] = torch.randn(h, i, generator=g) / i**0.5
    return w13, w2


def oracle_bytes_per_expert(spec: JobSpec) -> int:
    """What one expert's weights take in the oracle: bf16 source, fp32 quantize steps and
    the float64 dequantized copy (about 20 bytes per weight)."""
    return 3 * spec.intermediate * spec.hidden * 20


def rank_oracle(spec: JobSpec, tokens: dict[str, torch.Tensor], fmt: str) -> OracleResult:
    """The oracle of one rank's tokens (`rank_tokens`) in format `fmt`, building the weights
    of only the experts they route to, at most `ORACLE_CHUNK_BYTES` of them at a time."""
    import torch

    from moe_ep.oracle import oracle_forward

    ids = tokens["ids"]
    needed = sorted({int(v) for v in ids[ids >= 0].unique()}) or [0]
    per_chunk = max(1, ORACLE_CHUNK_BYTES // oracle_bytes_per_expert(spec))
    sums: list[torch.Tensor] = []  # exact, terms, flip: each adds up over the chunks
    for start in range(0, len(needed), per_chunk):
        chunk = needed[start : start + per_chunk]
        w13, w2 = expert_weights(spec, chunk)
        remap = torch.full((spec.experts,), -1, dtype=torch.long)
        remap[chunk] = torch.arange(len(chunk))
        local_ids = torch.where(ids >= 0, remap[ids.clamp(min=0)], -1)
        part = oracle_forward(tokens["x"], local_ids, tokens["topk_weights"], w13, w2, fmt=fmt)
        del w13, w2
        new = [part.exact, part.terms, part.flip]
        sums = new if not sums else [a.add_(b) for a, b in zip(sums, new, strict=True)]
    exact, terms, flip = sums
    # the other fields (the format ...) are the same in every part
    return dataclasses.replace(
        part, output=exact.to(torch.bfloat16), exact=exact, terms=terms, flip=flip
    )

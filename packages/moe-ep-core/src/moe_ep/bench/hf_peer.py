"""Hugging Face transformers' MoE experts block as a benchmark peer (optional: the root
pyproject's `bench` dependency group; never a runtime or dev dependency)."""

from __future__ import annotations

from collections.abc import Callable

import torch

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
"""transformers 5.x `experts_implementation`s that run on CPU (deepgemm / sonicmoe: CUDA)."""
BATCHED_MM_MAX_BYTES = 2 << 30
"""batched_mm gathers one weight matrix per (token, slot): skipped above this many bytes."""


def unavailable() -> str | None:
    """Why the peer cannot run here, or None."""
    try:
        import transformers  # noqa: F401
        from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: F401
    except ImportError as exc:
        return f"transformers not installed (uv sync --group bench): {exc}"
    return None


def experts_forward(
    w13: torch.Tensor, w2: torch.Tensor, top_k: int, implementation: str
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """Qwen3-MoE's experts block on the given weights (`w13 [E, 2I, H]` gate then up rows,
    `w2 [E, H, I]`, shared, not copied) with `implementation`; call it with
    `(x [T, H], topk_ids [T, k], topk_weights [T, k])`."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    e, two_i, h = (int(d) for d in w13.shape)
    config = Qwen3MoeConfig(
        hidden_size=h,
        moe_intermediate_size=two_i // 2,
        num_experts=e,
        num_experts_per_tok=top_k,
        hidden_act="silu",
    )
    config._experts_implementation = implementation
    with torch.device("meta"):
        block = Qwen3MoeExperts(config)
    block.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    block.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    block.eval()

    def forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return block(x, ids, weights.to(x.dtype))

    return forward

"""Small transformers 5.x MoE models from configs, random weights (no downloads)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB, HIDDEN, EXPERTS = 128, 64, 8
ARCHS = ("qwen3_moe", "mixtral", "deepseek_v3")
GEN = {"max_new_tokens": 16, "min_new_tokens": 16, "do_sample": False}
"""Greedy, a fixed length on every rank (each MoE layer is a collective)."""


def config(arch: str) -> Any:
    """A two-layer config of `arch` with 8 experts, top-2."""
    import transformers as tf

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "num_experts_per_tok": 2,
    }
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common, head_dim=16, num_key_value_heads=2, intermediate_size=128,
            moe_intermediate_size=32, num_experts=EXPERTS,
        )  # fmt: skip
    if arch == "mixtral":
        return tf.MixtralConfig(
            **common, head_dim=16, num_key_value_heads=2, intermediate_size=32,
            num_local_experts=EXPERTS,
        )  # fmt: skip
    if arch == "deepseek_v3":  # layer 0 dense, layer 1 routed experts + a shared expert
        return tf.DeepseekV3Config(
            **common, num_key_value_heads=4, intermediate_size=128, moe_intermediate_size=32,
            n_routed_experts=EXPERTS, n_shared_experts=1, n_group=2, topk_group=1,
            first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16,
        )  # fmt: skip
    if arch == "gpt_oss":
        return tf.GptOssConfig(
            **common, head_dim=16, num_key_value_heads=2, intermediate_size=32,
            num_local_experts=EXPERTS,
        )  # fmt: skip
    raise ValueError(arch)


def model(arch: str, fault: str | None = None, dtype: torch.dtype = torch.bfloat16) -> Any:
    """`arch`'s model, the same weights on every call and rank; the experts redrawn at scale
    fan_in**-0.5 so that they move the logits (at transformers' 0.02 init they barely do).

    fault: "swap_gate_up" swaps the gate and up halves of gate_up_proj, "zero_down" zeroes
    down_proj (planted faults the token comparison must see).
    """
    from transformers import AutoModelForCausalLM

    from moe_ep.integrations.transformers import experts_modules

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(config(arch), dtype=dtype).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, experts in experts_modules(m):
            for p in (experts.gate_up_proj, experts.down_proj):
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            if fault == "swap_gate_up":
                i = experts.gate_up_proj.shape[1] // 2
                experts.gate_up_proj.copy_(experts.gate_up_proj.roll(i, dims=1))
            elif fault == "zero_down":
                experts.down_proj.zero_()
    return m


NEAR_TIE = 0.02
"""A logit gap under which the reference's greedy choice is within rounding of a tie: about
5 bf16 ulps of its logits (|logit| < 1 here); moe-ep's expert sums round differently from
transformers' eager bf16 loop (measured max |logit difference| 0.004-0.006 at one forward)."""


def confident_disagreements(
    want: torch.Tensor, reference_logits: torch.Tensor, logits: torch.Tensor, prompt_len: int
) -> tuple[list[str], int]:
    """Teacher-forced on the reference's greedy sequence `want`: each generated position
    where the reference's top-2 logit gap is at least `NEAR_TIE` and the other model's
    greedy choice (`logits`) is another token, and how many positions were that confident.
    (Under a near-tie any change of rounding may flip the choice; a confident one must not.)"""
    top2 = reference_logits.float().topk(2, dim=-1).values
    confident = (top2[..., 0] - top2[..., 1]) >= NEAR_TIE
    choice = logits.float().argmax(dim=-1)
    bad = []
    for row in range(want.shape[0]):
        for t in range(prompt_len - 1, want.shape[1] - 1):
            if confident[row, t] and choice[row, t] != want[row, t + 1]:
                bad.append(f"row {row} token {t + 1}")
    return bad, int(confident[:, prompt_len - 1 : -1].sum())


def prompt(rank: int, batch: int = 2, length: int = 8) -> torch.Tensor:
    """Rank `rank`'s prompt (each rank its own tokens)."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(rank))

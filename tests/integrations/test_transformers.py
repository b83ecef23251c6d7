"""moe-ep as the experts of transformers 5.x MoE models (`moe_ep.integrations.transformers`):
`generate()` gives the single-process transformers model's tokens at EP1 and EP2 (spawned
ranks, each with its own prompt and only its experts' shard), for Qwen3-MoE, Mixtral and
DeepSeek-V3; planted weight-mapping faults change them; experts moe-ep cannot express
(gpt-oss) and other bad input are refused before any collective.

transformers is optional (the `moe-ep-core[transformers]` extra, not in the dev group):
`uv run --with 'transformers>=5' pytest tests/integrations`; without it these skip.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "transformers",
    minversion="5",
    reason="transformers>=5 is optional (moe-ep-core[transformers]); run "
    "`uv run --with 'transformers>=5' pytest tests/integrations`",
)

import hf_models
import torch

from moe_ep import BootstrapConfig
from moe_ep.backends.portable.experts import prepack_layout
from moe_ep.errors import MoeEpUsageError
from moe_ep.integrations.transformers import shard_experts
from moe_ep.spawn import spawn_local


def _generate_worker(rank: int, world_size: int, fault: str | None = None) -> dict[str, Any]:
    """Per architecture: the replaced modules, whether every row's tokens equal
    transformers', and `first_confident_divergence`'s verdict."""
    torch.set_num_threads(1)
    out = {}
    for arch in hf_models.ARCHS:
        reference = hf_models.model(arch)  # the single-process transformers model
        model = hf_models.model(arch, fault)  # moe-ep's copy (faulted weights when asked)
        ids = hf_models.prompt(rank)
        with torch.no_grad():
            want = reference.generate(ids, **hf_models.GEN)
            with shard_experts(
                model, BootstrapConfig(world_size, rank), max_tokens_per_rank=want.numel()
            ) as sharded:
                e_local = hf_models.EXPERTS // world_size
                for m in sharded.modules:  # this rank's shard only
                    assert m.experts == range(rank * e_local, (rank + 1) * e_local)
                    assert m.layer.kernel_name == "any_bf16_bf16_bf16_torch"
                got = model.generate(ids, **hf_models.GEN)
                forced = model(want).logits  # teacher-forced on the reference's tokens
            bad, checked = hf_models.confident_disagreements(
                want, reference(want).logits, forced, ids.shape[1]
            )
        out[arch] = {
            "names": sharded.names,
            "equal": torch.equal(want, got),
            "bad": bad,
            "checked": checked,
            "tokens": want.tolist(),
        }
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("world_size", (1, 2))
def test_generate_gives_the_transformers_tokens(world_size: int) -> None:
    results = spawn_local(_generate_worker, world_size, timeout_s=300)
    equal = 0
    for rank, per_arch in enumerate(results):
        for arch, r in per_arch.items():
            assert r["names"], arch
            assert not r["bad"], f"{arch} EP{world_size} rank {rank}: {r['bad']}"
            assert r["checked"] >= 8, (arch, r["checked"])  # of 32: random models tie often
            equal += r["equal"]
    assert equal >= 1  # and generate()'s own tokens, near-ties and all, match outright
    if world_size == 2:  # each rank its own prompt
        assert results[0]["qwen3_moe"]["tokens"] != results[1]["qwen3_moe"]["tokens"]


@pytest.mark.multirank
@pytest.mark.parametrize("fault", ("swap_gate_up", "zero_down"))
def test_a_planted_weight_mapping_fault_changes_the_tokens(fault: str) -> None:
    (per_arch,) = spawn_local(_generate_worker, 1, fault, timeout_s=300)
    for arch, r in per_arch.items():
        assert not r["equal"] and len(r["bad"]) >= 8, f"{arch}: {fault} went unseen: {r}"


def test_the_experts_leave_the_model() -> None:
    model = hf_models.model("qwen3_moe")
    with shard_experts(model, BootstrapConfig(1, 0), max_tokens_per_rank=16) as sharded:
        assert sharded.names == ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
        assert [model.get_submodule(n) for n in sharded.names] == list(sharded.modules)
        assert not any("experts" in n for n, _ in model.named_parameters())
        assert repr(sharded.modules[0]).startswith("MoeEpExperts(experts 0..7 of 8")


@pytest.mark.skipif(
    prepack_layout(torch.device("cpu")) != "k16",
    reason="no k-order packing of bf16 weights on this CPU (it keeps the default there)",
)
def test_on_an_avx2_cpu_the_adapter_packs_its_own_copy_of_the_experts() -> None:
    """The adapter's copy of the rank's experts is the layer's alone: packed for the k order
    (the faster decode) at no memory cost, the layer keeping no pack beside it; a config
    object passed by the caller is taken as it is."""
    from moe_ep.backends.portable.configs import Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig

    model = hf_models.model("qwen3_moe")
    with shard_experts(model, BootstrapConfig(1, 0), max_tokens_per_rank=16) as sharded:
        for m in sharded.modules:
            assert m.layer.config.cpu_prepacked_weights is True
            assert m.layer._weights is None and m.layer._kernel.prepared.kpack13 is not None
    model = hf_models.model("qwen3_moe")
    config = Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig()
    with shard_experts(
        model, BootstrapConfig(1, 0), max_tokens_per_rank=16, backend=config
    ) as sharded:
        for m in sharded.modules:
            assert m.layer.config.cpu_prepacked_weights is None
            assert m.layer._weights is not None


@pytest.mark.parametrize(
    ("build", "world_size", "message"),
    [
        (lambda: hf_models.model("gpt_oss"), 1,
         r"model\.layers\.0\.mlp\.experts \(GptOssExperts\): has_bias=True; .*cannot express "
         r"expert biases"),
        (lambda: hf_models.model("qwen3_moe", dtype=torch.float32), 1,
         r"gate_up_proj is torch\.float32: the model must run in bfloat16"),
        (lambda: hf_models.model("qwen3_moe"), 3,
         r"num_experts must be divisible by world_size: got num_experts=8, world_size=3"),
    ],
)  # fmt: skip
def test_what_moe_ep_cannot_run_is_refused_before_any_collective(
    build: Any, world_size: int, message: str
) -> None:
    model = build()
    # world size > 1 in one process: a refusal that came after joining the group would hang
    with pytest.raises(MoeEpUsageError, match=message):
        shard_experts(model, BootstrapConfig(world_size, 0, timeout_s=5), max_tokens_per_rank=16)
    assert not any(type(m).__name__ == "MoeEpExperts" for m in model.modules())


def test_gpt_oss_gate_is_refused_even_without_biases() -> None:
    model = hf_models.model("gpt_oss")
    for _, experts in model.named_modules():
        if type(experts).__name__ == "GptOssExperts":
            experts.has_bias = False
            experts.is_transposed = False
            experts.is_concatenated = True
    with pytest.raises(MoeEpUsageError, match=r"its own gate function GptOssExperts\._apply_gate"):
        shard_experts(model, BootstrapConfig(1, 0), max_tokens_per_rank=16)


def test_a_model_without_experts_is_refused() -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    dense = AutoModelForCausalLM.from_config(config)
    with pytest.raises(MoeEpUsageError, match="has no transformers experts module"):
        shard_experts(dense, BootstrapConfig(1, 0), max_tokens_per_rank=16)


def test_the_runtime_md_recipe_runs() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "docs"))
    from doc_blocks import REPO, python_blocks, run_block

    (block,) = (b for b in python_blocks(REPO / "docs" / "runtime.md") if "shard_experts" in b.code)
    assert block.skip is not None  # the default run has no transformers; this test runs it
    done = run_block(block)
    assert done.returncode == 0, done.stderr[-3000:]

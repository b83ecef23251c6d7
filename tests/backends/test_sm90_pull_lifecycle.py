"""Lifecycle of the pull kernel wrapper on CPU, with the GPU-only pieces replaced by fakes.

`_compile` (cutlass, NVSHMEM) and `_launch` are swapped for fakes that record calls, so what
is tested is our own logic: one compiled kernel + workspaces per (config, geometry, device)
shared by layers, ref-counted release with the free on the last `destroy()`, staging into the
pooled buffers, output copy-out, and the errors. The real launch has never run on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from backend_testing import fake_gpu_pieces, make_kernel, routed_tensors

import moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.kernel as pull
from moe_ep.backends.support.cutedsl.mega_kernel import STAGED, CompiledEntry, storage_tensor
from moe_ep.backends.support.launch_args import LaunchGeometry
from moe_ep.errors import MoeEpUsageError
from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig as Config
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.args import tensor_specs

H, I, E = 256, 128, 4  # noqa: E741 - the glossary names (I = intermediate)


@pytest.fixture
def fakes(monkeypatch):
    compiled: list[object] = []
    launches: list[object] = []

    def fake_compile(self, g):
        staging = {
            s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype))
            for s in tensor_specs(g)
            if s.name in ("activation", "activation_sf", "topk_idx", "topk_weights")
            or s.name == "output_activation"
        }
        entry = CompiledEntry(None, torch.zeros(1), torch.zeros(1), staging, (), None, {})
        compiled.append(entry)
        return entry

    def fake_launch(self, entry):
        launches.append(entry)
        # Stand-in for the kernel: output row r = r + 1 in every column.
        rows = torch.arange(entry.staging["output_activation"].shape[0]) + 1.0
        entry.staging["output_activation"].copy_(
            rows[:, None].expand_as(entry.staging["output_activation"])
        )

    freed = fake_gpu_pieces(
        monkeypatch,
        pull.Sm90Fp8Fp8Bf16PullCutedslKernel,
        pull._POOL,
        compile=fake_compile,
        launch=fake_launch,
    )
    return compiled, freed, launches


def _kernel(config=None, hidden=H, runtime=None):
    return make_kernel(
        pull.Sm90Fp8Fp8Bf16PullCutedslKernel,
        config or Config(top_k=2),
        num_experts=E,
        intermediate=I,
        hidden=hidden,
        max_tokens=8,
        runtime=runtime,
    )


def _tensors(n=3, k=2, hidden=H):
    return routed_tensors(n, k, hidden, E)


def test_layers_of_one_geometry_share_one_compile_and_free_on_last_destroy(fakes):
    compiled, freed, _ = fakes
    a, b = _kernel(), _kernel()
    other = _kernel(hidden=2 * H)
    for k in (a, b, other):
        k.warmup()
    assert len(compiled) == 2  # a and b share; other has another geometry
    a.destroy()
    assert freed == []
    b.destroy()
    assert freed == [compiled[0]]
    b.destroy()  # idempotent: no second free
    assert freed == [compiled[0]]
    other.destroy()
    assert freed == compiled
    with pytest.raises(MoeEpUsageError, match="destroyed"):
        a.stage_inputs(tensors=_tensors(), output=torch.empty(3, H, dtype=torch.bfloat16))


def test_staging_lands_in_the_pooled_buffers_and_output_rows_are_copied(fakes):
    compiled, _, launches = fakes
    k = _kernel()
    t = _tensors(n=3)
    out = torch.zeros(3, H, dtype=torch.bfloat16)
    staged = k.stage_inputs(tensors=t, output=out)
    buf = compiled[0].staging
    want = pull.stage_pull_inputs(t.hidden_states, t.topk_ids, t.topk_weights, max_tokens=8)
    assert torch.equal(buf["activation"].view(torch.uint8), want.activation.view(torch.uint8))
    assert torch.equal(buf["activation_sf"], want.activation_scales)
    assert torch.equal(buf["topk_idx"], want.topk_ids)
    assert torch.equal(buf["topk_weights"], want.topk_weights)
    got = k.compute_staged(staged=staged)
    assert got is out and len(launches) == 1
    assert torch.equal(out[:, 0], torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
    k.destroy()


def test_top_k_comes_from_config_or_first_inputs_and_must_not_change(fakes):
    compiled, _, _ = fakes
    lazy = _kernel(config=Config())
    lazy.warmup()  # top_k unknown: nothing compiled yet, but the barrier still runs
    assert compiled == [] and lazy.runtime.barriers == 1
    lazy.stage_inputs(tensors=_tensors(k=2), output=torch.empty(3, H, dtype=torch.bfloat16))
    assert len(compiled) == 1
    with pytest.raises(MoeEpUsageError, match="top_k=2"):
        lazy.stage_inputs(tensors=_tensors(k=3), output=torch.empty(3, H, dtype=torch.bfloat16))
    fixed = _kernel(config=Config(top_k=4))
    with pytest.raises(MoeEpUsageError, match="top_k"):
        fixed.stage_inputs(tensors=_tensors(k=2), output=torch.empty(3, H, dtype=torch.bfloat16))
    lazy.destroy()
    fixed.destroy()


def test_unavailable_kernel_raises_before_compiling(monkeypatch):
    monkeypatch.setattr(
        pull.Sm90Fp8Fp8Bf16PullCutedslKernel,
        "availability",
        classmethod(lambda cls: (False, "no CUDA device visible")),
    )
    k = _kernel()
    from moe_ep.errors import MoeEpUnavailableError

    with pytest.raises(MoeEpUnavailableError, match="no CUDA device visible"):
        k.warmup()
    k.destroy()


def test_symmetric_staging_is_allocated_as_bytes(monkeypatch):
    # nvshmem4py sizes an allocation from its dtype table; releases without fp8 in it
    # refuse `tensor(shape, dtype=float8_e4m3fn)`. The fake accepts bytes only, as those do.
    import sys
    import types

    calls: list[tuple[tuple[int, ...], torch.dtype]] = []

    def tensor(shape, dtype=torch.float32):
        calls.append((tuple(shape), dtype))
        if dtype is not torch.uint8:
            raise ValueError(f"Unsupported torch dtype: {dtype}")
        return torch.full(shape, 7, dtype=dtype)

    core = types.ModuleType("nvshmem.core")
    core.tensor = tensor  # type: ignore[attr-defined]
    root = types.ModuleType("nvshmem")
    root.core = core  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nvshmem", root)
    monkeypatch.setitem(sys.modules, "nvshmem.core", core)
    g = LaunchGeometry(
        world_size=2,
        rank=1,
        max_tokens_per_rank=16,
        top_k=4,
        num_experts=E,
        hidden_size=H,
        intermediate_size=I,
    )
    staged = [s for s in tensor_specs(g) if s.name in STAGED]
    for spec in staged:  # allocated as the launch's `_compile` allocates them: bytes
        dtype = getattr(torch, spec.dtype)
        t = storage_tensor(spec, lambda n: core.tensor((n,), dtype=torch.uint8))
        assert t.shape == spec.shape and t.dtype == dtype and t.is_contiguous()
        assert not t.view(torch.uint8).any()
        assert calls[-1] == ((t.numel() * t.element_size(),), torch.uint8)
    assert {getattr(torch, s.dtype) for s in staged} >= {torch.float8_e4m3fn}

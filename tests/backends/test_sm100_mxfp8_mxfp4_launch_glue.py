"""`sm100_mxfp8_mxfp4_bf16_cutedsl`'s real `_compile` / `_launch` (core's CuTe DSL lifecycle
with this kernel's hooks) on CPU, against recording fakes of cutlass, NVSHMEM and
cuda-bindings (`cute_fakes`, `sm100_fakes.install_fake_gpu`) and of the drop's kernel class.

Expectations come from FlashInfer 0.7.4's own launch code for this kernel
(`kernel_src/sm100/next_cutedsl_megamoe/shim/block_scaled.py`: `_build_kernel`,
`_allocate_kernel_workspace`, `_runtime_kwargs`, `_peer_mapper`; read, not copied) and from
the drop kernel's `__call__` signature (read from its source with `ast`), not from our code.
Never run on a GPU.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from backend_testing import FakeRuntime, routed_tensors
from cute_fakes import FakeCuteTensor, FakePtr, FakeStream, FakeSymBufferHost
from sm100_fakes import install_fake_gpu

import moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.kernel as mod
from moe_ep.types import FleetParams, MoEWeightPack
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig as Config,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.kernel import (
    COMBINE_REGION,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.kernel import (
    Sm100Mxfp8Mxfp4Bf16CutedslKernel as Kernel,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.upstream import Mxfp4KernelApi

H, I, E, T, K, WORLD, RANK = 256, 128, 4, 7, 2, 2, 1  # noqa: E741 - glossary names
TP = 8  # T = 7 tokens x top_k 2 = 14 routes, padded to 16: 8 rows
DROP_KERNEL = (
    Path(__file__).resolve().parents[2] / "vendor" / "sm100_next_cutedsl_megamoe" / "src"
    / "sources" / "kernel_src" / "blackwell" / "inference" / "mega"
    / "block_scaled_swap_ab_mega_moe_kernel.py"
)  # fmt: skip


def drop_call_parameters() -> tuple[list[str], list[str]]:
    """(all, required) parameter names of the drop kernel's `__call__`, from its source."""
    if not DROP_KERNEL.is_file():
        pytest.skip("run `uv run tools/vendor.py sync sm100_next_cutedsl_megamoe`")
    for node in ast.walk(ast.parse(DROP_KERNEL.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "BlockScaledSwapAbMegaMoeKernel":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__call__":
                    names = [a.arg for a in fn.args.args][1:]
                    return names, names[: len(names) - len(fn.args.defaults)]
    raise AssertionError("BlockScaledSwapAbMegaMoeKernel.__call__ not found")


class FakeWorkspaceTable:
    def __init__(self, regions: dict[str, tuple[int, int]]) -> None:
        self.regions = regions

    def offset(self, name: str) -> int:
        return self.regions[name][0]

    def nbytes(self, name: str) -> int:
        return self.regions[name][1]


def fake_api(gpu: Any) -> Mxfp4KernelApi:
    class FakeKernel:
        """Records its descriptors; a device-workspace table with the bf16 combine cells
        `[T, k, H]` after 256 bytes, as the drop's kernel registers them."""

        def __init__(self, problem: dict, impl: dict) -> None:
            self.problem, self.impl = problem, impl
            gpu.kernels.append(self)
            t, k, h = problem["max_tokens_per_rank"], problem["topk"], problem["hidden_size"]
            self.token_comm = SimpleNamespace(activation_sf_hidden_padded=-(-h // 32 // 16) * 16)
            self._device_workspace = FakeWorkspaceTable({COMBINE_REGION: (256, 2 * t * k * h)})
            self.sizes = (4096, 256 + 2 * t * k * h + 128)

        def get_workspace_sizes(self) -> tuple[int, int]:
            return self.sizes

    return Mxfp4KernelApi(
        kernel=FakeKernel,
        problem_desc=dict,
        impl_desc=dict,
        operand_major_k="OperandMajorMode.K",
        combine_format=lambda s: f"CombineFormat({s})",
        symmetric_buffer_host=FakeSymBufferHost,
    )


def _make(runtime: Any, seed: int = 0) -> Kernel:
    g = torch.Generator().manual_seed(seed)
    el = E // WORLD
    return Kernel(
        config=Config(top_k=K, gate_up_clamp=7.0),
        fleet=FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H),
        runtime=runtime,
        weights=MoEWeightPack(
            w13=torch.randn(el, 2 * I, H, generator=g).to(torch.bfloat16),
            w2=torch.randn(el, H, I, generator=g).to(torch.bfloat16),
        ),
    )


@pytest.fixture
def setup(monkeypatch):
    gpu = install_fake_gpu(monkeypatch, world_size=WORLD, rank=RANK)
    monkeypatch.setattr(sys.modules["cutlass"], "Int32", "cutlass.Int32", raising=False)
    monkeypatch.setattr(mod, "load_api", lambda: fake_api(gpu))
    monkeypatch.setattr(Kernel, "availability", classmethod(lambda c: (True, "")))
    # CPU allocations promise less than the kernel's 128-byte workspace alignment
    monkeypatch.setattr(mod.args, "WORKSPACE_ALIGN", 1)
    kernel = _make(FakeRuntime(rank=RANK, world_size=WORLD))
    yield kernel, gpu
    kernel.destroy()


def _forward(kernel: Kernel, n: int = 3) -> torch.Tensor:
    t = routed_tensors(n, K, H, E)
    out = torch.zeros(n, H, dtype=torch.bfloat16)
    return kernel.compute_staged(staged=kernel.stage_inputs(tensors=t, output=out))


def test_descriptors_are_flashinfers_for_this_kernel(setup):
    kernel, gpu = setup
    kernel.warmup()
    (k,) = gpu.kernels
    # block_scaled._build_kernel with Sm100BlockScaledMoeConfig(quant_kind="mxfp4_mxfp8")
    # defaults, standard inference, bf16 combine, no per-token scale, separate reduce
    assert k.problem == {
        "expert_count": E,  # global; the kernel slices world_size ways
        "intermediate_gateup_size": 2 * I,
        "hidden_size": H,
        "quant_kind": "mxfp4_mxfp8",
        "a_major_mode": "OperandMajorMode.K",
        "b_major_mode": "OperandMajorMode.K",
        "combine_format": "CombineFormat(bf16)",
        "gate_up_clamp": 7.0,
        "situ_beta": None,
        "situ_linear_beta": None,
        "swiglu_alpha": None,
        "swiglu_beta": None,
        "world_size": WORLD,
        "topk": K,
        "topk_index_dtype": "cutlass.Int32",
        "max_tokens_per_rank": TP,  # padded_tokens_per_rank
        "apply_topk_at_fc1": True,  # apply_routing_weights_before_fc2 default
        "fc1_activation_per_token_scale": False,
    }
    assert k.impl == {
        "architecture": "sm_100",
        "mma_instruction_mnk": (256, 128, 32),  # Sm100BlockScaledMoeConfig.instruction_k
        "mma_tiler_mnk": (256, 128, 128),
        "mma_k_mode": "1x",
        "cluster_shape_mn": (2, 1),
        "use_2cta_instrs": True,
        "schedule_policy": ("grouped", None),
        "token_padding_block": 64,
        "sf_padding_block": 128,
        "work_id_mode": "grid_stride",
        "fc2_use_bulk": False,
        "epi_flag_batches": (4, 2),
        "launch_cluster_count": 148 // 2,  # _max_active_clusters(cluster size 2)
        "token_in_flag_batch": 1,
        "token_back_mode": "epi_warps",
        "reduce_topk_in_kernel": False,
        "skip_topk_reduce": False,
        "topk_reduce_persistent": False,
    }


def test_buffers_and_call_arguments_are_the_kernels(setup):
    kernel, gpu = setup
    gpu.stream = 5
    kernel.warmup()
    ((_, args),) = gpu.compiles
    names, required = drop_call_parameters()
    assert set(required) <= set(args) <= set(names)
    want = {  # _runtime_kwargs / BlockScaledSymmBuffer.__init__
        "activation": ((TP, H), torch.float8_e4m3fn, True),
        "activation_sf": ((TP, 16), torch.float8_e8m0fnu, True),
        "topk_indices": ((TP, K), torch.int32, True),  # local there; symmetric here
        "topk_scores": ((TP, K), torch.float32, True),
        "output_activation": ((TP, H), torch.bfloat16, False),
    }
    heap = {s.data_ptr() for s in gpu.symmetric}
    for name, (shape, dtype, symmetric) in want.items():
        ct = args[name]
        assert isinstance(ct, FakeCuteTensor), name
        assert (tuple(ct.tensor.shape), ct.tensor.dtype) == (shape, dtype), name
        assert (ct.tensor.untyped_storage().data_ptr() in heap) is symmetric, name
        assert ct.leading_dim == 1, name
    assert args["topk_scores"].assumed_align == 4 and args["activation"].assumed_align == 16
    assert int(args["topk_indices"].tensor.max()) == -1
    # weights: K-major packed e2m1 (the kernel's Float4E2M1FN), E8M0 planes
    w1, w2 = args["fc1_weight"].tensor, args["fc2_weight"].tensor
    assert w1.dtype == torch.float4_e2m1fn_x2 and tuple(w1.shape) == (E // WORLD, H // 2, 2 * I)
    assert w2.dtype == torch.float4_e2m1fn_x2 and tuple(w2.shape) == (E // WORLD, I // 2, H)
    assert args["fc1_weight"].leading_dim == 1 == args["fc2_weight"].leading_dim
    assert args["fc1_weight_sf"].tensor.dtype == torch.float8_e8m0fnu
    # workspaces: raw uint8 gmem pointers at the zeroed local / symmetric buffers
    shared = gpu.symmetric[0]
    local = kernel._pooled.local_workspace
    (kobj,) = gpu.kernels
    assert (local.numel(), shared.numel()) == kobj.sizes
    assert not local.any() and not shared.any()
    assert args["shared_workspace"] == FakePtr("cutlass.Uint8", shared.data_ptr(), "gmem", 1)
    assert args["local_workspace"] == FakePtr("cutlass.Uint8", local.data_ptr(), "gmem", 1)
    # _peer_mapper: SymmetricBufferHost over the shared workspace
    peers = gpu.peers[id(shared)]
    assert args["peer_rank_ptr_mapper_host"].kwargs == {
        "base_address": shared.data_ptr(),
        "offsets": tuple(p.data_ptr() - shared.data_ptr() for p in peers),
        "rank": RANK,
        "max_ranks": WORLD,
    }
    assert args["stream"] == FakeStream(5)


def test_launch_runs_on_the_current_stream_with_the_layers_weights(setup):
    kernel, gpu = setup
    other = _make(FakeRuntime(rank=RANK, world_size=WORLD), seed=1)  # same geometry: pooled
    try:
        gpu.stream = 11
        _forward(kernel)
        _forward(other)
        assert len(gpu.compiles) == 1
        first, second = gpu.compiled.launches
        assert [first["stream"], second["stream"]] == [FakeStream(11)] * 2
        for name in ("fc1_weight", "fc1_weight_sf", "fc2_weight", "fc2_weight_sf"):
            assert first[name].tensor.data_ptr() != second[name].tensor.data_ptr(), name
        assert first["activation"] is second["activation"]  # the pooled staging
    finally:
        other.destroy()


def test_the_combine_cells_are_the_kernels_region(setup):
    kernel, gpu = setup
    kernel.warmup()
    cells = kernel._pooled.combine
    # the first max_tokens_per_rank rows of the kernel's [TP, k, H] bf16 region at 256
    assert cells.shape == (T, K, H) and cells.dtype == torch.bfloat16
    assert cells.data_ptr() == gpu.symmetric[0].data_ptr() + 256


def test_destroy_frees_every_symmetric_buffer_once(setup):
    kernel, gpu = setup
    kernel.warmup()
    allocated = list(gpu.symmetric)
    kernel.destroy()
    assert sorted(map(id, gpu.freed)) == sorted(map(id, allocated))
    assert len(allocated) == 5  # shared workspace + the four staged inputs


def test_workspace_pointers_must_be_128_byte_aligned(setup):
    from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl import args

    args.WORKSPACE_ALIGN = 128  # the fixture's monkeypatch restores the CPU value after
    with pytest.raises(RuntimeError, match="not 128-byte aligned"):
        args.workspace_pointer(128 * 7 + 64)
    assert args.workspace_pointer(128 * 7).assumed_align == 128

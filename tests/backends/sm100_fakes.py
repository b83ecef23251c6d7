"""Recording stand-ins for what the sm100 CuTe DSL launch path imports on a GPU machine.

`install_fake_gpu(monkeypatch, ...)` installs `cute_fakes`' fake `cutlass`, `cuda.bindings`
and `nvshmem.core` modules and replaces the drop loaders of the nvfp4 / mxfp8 kernel modules
(`kernels/*/kernel.py`) with a recording fake kernel class. Then the
real `_compile` / `_launch` of `CutedslMegaKernel` run on CPU tensors and every call they
make (kernel constructor, allocations, `from_dlpack`, `make_ptr`, peer lookups,
`cute.compile`, the launch) is recorded in a `FakeGpu` for the tests to compare with the
drop's own runners. Nothing here knows the expected values; the tests state them.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import ModuleType

import pytest
from cute_fakes import (
    FakeCuteTensor,
    FakeGpu,
    FakePtr,
    FakeStream,
    FakeSymBufferHost,
    install_fake_modules,
    recording_kernel_class,
)

__all__ = [
    "FakeCuteTensor",
    "FakeGpu",
    "FakePtr",
    "FakeStream",
    "drop_signature",
    "fake_kernel_class",
    "install_fake_gpu",
]

DROP_SRC = Path(__file__).resolve().parents[2] / "vendor" / "sm100_cutedsl_megamoe" / "src"
DROP_FILES = {
    "nvfp4": ("moe_nvfp4_swapab/megamoe_kernel.py", "Sm100MegaMoEKernel"),
    "mxfp8": ("moe_mxfp8_glu/megamoe_kernel_mxfp8.py", "Sm100MegaMoEMxfp8Kernel"),
}


def drop_signature(kind: str, method: str) -> list[str]:
    """Parameter names (without `self`) of the drop kernel's `method`, read from its source
    with `ast` (no cutlass import); skips when the drop is not materialized."""
    rel, cls_name = DROP_FILES[kind]
    path = DROP_SRC / rel
    if not path.is_file():
        pytest.skip(
            f"the sm100 drop is not materialized ({path} missing); run "
            "`uv run tools/vendor.py sync sm100_cutedsl_megamoe`"
        )
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls_name:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == method:
                    a = fn.args
                    return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)][1:]
    raise AssertionError(f"{cls_name}.{method} not found in {path}")


def fake_kernel_class(gpu: FakeGpu, kind: str) -> type:
    """A drop-kernel stand-in for `kind` with the sm100 drop's `combine_quant` region
    (`cute_fakes.recording_kernel_class`)."""
    return recording_kernel_class(gpu, "combine_quant", kind)


def install_fake_gpu(
    monkeypatch: pytest.MonkeyPatch, *, world_size: int, rank: int, clusters: int = 148
) -> FakeGpu:
    """Install the fakes (module docstring); `clusters // cluster size` is what the fake
    `cutlass.utils.HardwareInfo().get_max_active_clusters` answers (one CTA per SM)."""
    import moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.kernel as mx
    import moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.kernel as nv
    from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.upstream import Mxfp8KernelApi
    from moe_ep_sm100.kernels.sm100_nvfp4_nvfp4_bf16_cutedsl.upstream import Nvfp4KernelApi

    gpu = install_fake_modules(monkeypatch, world_size=world_size, rank=rank)
    nv_api = Nvfp4KernelApi(
        kernel=fake_kernel_class(gpu, "nvfp4"),
        token_padding_block=64,
        sf_padding_block=128,
        combine_format_bf16="CombineFormat(bf16)",
        sym_buffer_host=FakeSymBufferHost,
    )
    mx_api = Mxfp8KernelApi(
        kernel=fake_kernel_class(gpu, "mxfp8"),
        token_padding_block=128,
        sf_padding_block=128,
        sym_buffer_host=FakeSymBufferHost,
    )
    monkeypatch.setattr(nv, "load_nvfp4_api", lambda: nv_api)
    monkeypatch.setattr(mx, "load_mxfp8_api", lambda: mx_api)

    class HardwareInfo:
        def get_max_active_clusters(self, size: int) -> int:
            return clusters // size

    utils = ModuleType("cutlass.utils")
    utils.HardwareInfo = HardwareInfo  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cutlass.utils", utils)
    monkeypatch.setattr(sys.modules["cutlass"], "utils", utils, raising=False)
    return gpu

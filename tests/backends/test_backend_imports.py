"""Import boundaries of the backend packages, read from their import statements.

- A backend reaches a drop only through the drop package's `__init__` (`moe_ep_drop_*`, no
  submodule), never the drop's `src/` packages (`common`, `src`, `moe_hopper_fp8`, ...).
- Importing a backend package (configs) or any `moe_ep.backends.support` module pulls in
  neither torch, cutlass, NVSHMEM, nor a drop.
- Each GPU kernel is the folder `<package>/kernels/<taxonomy name>/`, whose docstring names
  its upstream bytes.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import moe_ep_sm90
import moe_ep_sm100
from moe_ep.backends.support.pooling.workspace_pool import WorkspacePool

PACKAGES = [Path(moe_ep_sm90.__file__).parent, Path(moe_ep_sm100.__file__).parent]
# Top-level names of the drops' src/ trees (both CuTe DSL drops).
DROP_SRC_NAMES = {
    "common",
    "src",
    "moe_hopper_fp8",
    "moe_hopper_bf16",
    "moe_nvfp4_swapab",
    "moe_mxfp8_glu",
    "moe_mxfp8_bf16_glu",
    "moe_bf16_glu",
}


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, node.lineno))
    return out


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.name)
def test_backends_use_drops_only_through_their_package(pkg):
    files = sorted(pkg.rglob("*.py"))
    assert files
    bad = []
    for path in files:
        for module, line in _imports(path):
            top = module.split(".")[0]
            if top in DROP_SRC_NAMES:
                bad.append(f"{path.name}:{line} imports drop source {module}")
            if top.startswith("moe_ep_drop_") and module != top:
                bad.append(f"{path.name}:{line} imports {module} (only the package is allowed)")
    assert not bad, bad


def test_importing_the_packages_stays_light():
    code = (
        "import sys, moe_ep_sm90, moe_ep_sm100\n"
        "from moe_ep.backends.support import (\n"
        "    availability, config_checks, drop_access, launch_args, package_attrs)\n"
        "from moe_ep.backends.support.pooling import pooled_kernel, workspace_pool\n"
        "from moe_ep.backends.support.cutedsl import compile_fakes\n"
        "import moe_ep_sm90.compile_check, moe_ep_sm100.compile_check\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('cutlass', 'nvshmem', 'moe_ep_drop_sm90_pull', 'moe_ep_drop_sm90_push', "
        "'moe_ep_drop_sm90_push_cuda_deps', 'moe_ep_drop_sm100_cutedsl', 'common', "
        "'moe_hopper_fp8', 'moe_hopper_bf16', 'deep_gemm', 'tvm_ffi', 'torch')]\n"
        "print(sorted({m.split('.')[0] for m in heavy}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout


GPU_KERNELS = (
    "sm90_bf16_bf16_bf16_pull_cutedsl",
    "sm90_fp8_fp8_bf16_pull_cutedsl",
    "sm90_fp8_fp8_bf16_push_cuda",
    "sm90_fp8_mxfp4_bf16_pull_cutedsl",
    "sm90_fp8_nvfp4_bf16_pull_cutedsl",
    "sm100_nvfp4_nvfp4_bf16_cutedsl",
    "sm100_mxfp8_mxfp8_bf16_cutedsl",
    "sm100_mxfp8_mxfp4_bf16_cutedsl",
    "sm100_fp8_fp4_bf16_deepgemm",
)


@pytest.mark.parametrize("name", GPU_KERNELS)
def test_every_gpu_kernel_pools_through_the_support_pool(name):
    from moe_ep.registry import get_kernel

    assert isinstance(get_kernel(name).pool, WorkspacePool)


def test_workspace_pool_shares_and_frees_on_last_release():
    freed: list[str] = []
    pool = WorkspacePool(free=freed.append)
    made: list[int] = []

    def create() -> str:
        made.append(1)
        return f"ws{len(made)}"

    a = pool.acquire(("geom", 1), create)
    b = pool.acquire(("geom", 1), create)
    c = pool.acquire(("geom", 2), create)
    assert a == b == "ws1" and c == "ws2" and len(made) == 2
    assert pool.refs(("geom", 1)) == 2
    assert pool.release(("geom", 1)) is False and freed == []
    assert pool.release(("geom", 1)) is True and freed == ["ws1"]
    assert pool.release(("geom", 1)) is False  # already gone: no double free
    assert len(pool) == 1


ROOT = Path(__file__).resolve().parents[2]


def _backend_entry_points() -> list[importlib.metadata.EntryPoint]:
    eps = importlib.metadata.entry_points(group="moe_ep.backends")
    return sorted(
        (ep for ep in eps if ep.module.split(".")[0] in ("moe_ep_sm90", "moe_ep_sm100")),
        key=lambda ep: ep.name,
    )


def test_every_gpu_kernel_has_its_entry_point():
    assert [ep.name for ep in _backend_entry_points()] == sorted(GPU_KERNELS)


@pytest.mark.parametrize("ep", _backend_entry_points(), ids=lambda ep: ep.name)
def test_a_kernel_lives_in_the_folder_of_its_taxonomy_name(ep):
    """Entry `name = "<pkg>.kernels.<name>.kernel:Class"`, and the folder's docstring names
    the kernel and its upstream bytes: an existing `vendor/<drop>/src/...` path, or says
    that none are vendored."""
    package = ep.module.split(".")[0]
    assert ep.module == f"{package}.kernels.{ep.name}.kernel"
    folder = importlib.import_module(f"{package}.kernels.{ep.name}")
    doc = folder.__doc__ or ""
    assert doc.startswith(f"`{ep.name}`"), doc[:80]
    assert "Upstream bytes:" in doc
    vendored = re.findall(r"`(vendor/[^`]+/)`", doc)
    assert vendored or "none vendored" in doc, doc
    for path in vendored:
        drop = path.split("/")[1]
        assert (ROOT / "vendor" / drop / "VENDOR.md").is_file(), path
    assert ep.load().kernel_name == ep.name

"""Import boundaries of the backend packages, read from their import statements.

- A backend reaches a drop only through the drop package's `__init__` (`moe_ep_drop_*`, no
  submodule), never the drop's `src/` packages (`common`, `src`, `moe_hopper_fp8`, ...).
- Importing a backend package (configs) or any `moe_ep.backends.support` module pulls in
  neither torch, cutlass, NVSHMEM, nor a drop.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import moe_ep_sm90
import moe_ep_sm100
from moe_ep_sm90.pool import WorkspacePool
from moe_ep_sm100.pool import WorkspacePool as Sm100WorkspacePool

PACKAGES = [Path(moe_ep_sm90.__file__).parent, Path(moe_ep_sm100.__file__).parent]
# Top-level names of the drops' src/ trees (both CuTe DSL drops).
DROP_SRC_NAMES = {
    "common",
    "src",
    "moe_hopper_fp8",
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
        "    args, compile_check, configs, drops, hardware, pool, pooled)\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('cutlass', 'nvshmem', 'moe_ep_drop_sm90_pull', 'moe_ep_drop_sm90_push', "
        "'moe_ep_drop_sm90_push_cuda_deps', 'moe_ep_drop_sm100_cutedsl', 'common', "
        "'moe_hopper_fp8', 'deep_gemm', 'tvm_ffi', 'torch')]\n"
        "print(sorted({m.split('.')[0] for m in heavy}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_package_pools_are_the_support_pool():
    from moe_ep.backends.support.pool import WorkspacePool as SupportPool

    assert WorkspacePool is SupportPool and Sm100WorkspacePool is SupportPool


@pytest.mark.parametrize("pool_cls", [WorkspacePool, Sm100WorkspacePool])
def test_workspace_pool_shares_and_frees_on_last_release(pool_cls):
    freed: list[str] = []
    pool = pool_cls(free=freed.append)
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

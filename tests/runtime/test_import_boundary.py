"""Import boundaries, read from import statements (ast), plus one live check.

- `moe_ep.runtime` and the modules it is built from (config, device, env, launch, errors)
  import no backend (`moe_ep.backends.*` other than the contract `moe_ep.backends.base`,
  `moe_ep_sm90`, `moe_ep_sm100`) and no drop, directly or through other moe_ep modules.
- No module under packages/moe-ep-core imports `moe_ep_sm90`, `moe_ep_sm100` or a drop
  package by name: backends are reached through entry points only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "packages/moe-ep-core/src"
RUNTIME_MODULES = [
    "moe_ep.runtime",
    "moe_ep.config",
    "moe_ep.device",
    "moe_ep.env",
    "moe_ep.launch",
]
BACKEND_PACKAGES = ("moe_ep_sm90", "moe_ep_sm100")
# Drop packages (`moe_ep_drop_*`) and the generic top-level names the CuTe DSL drops import
# from their src/ (see shared notes on the drops): none may be imported by core by name.
DROP_TOP_LEVEL = ("src", "common", "moe_nvfp4_swapab", "moe_hopper_fp8", "moe_mxfp8_glu")
CONTRACT = "moe_ep.backends.base"


def _module_path(name: str) -> Path | None:
    base = CORE.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path, module: str) -> set[str]:
    """Absolute names of every module `path` imports (any nesting, TYPE_CHECKING excluded),
    plus string literals given to importlib.import_module / __import__."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    type_checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_checking.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args:
            func = ast.unparse(node.func)
            arg = node.args[0]
            if func.endswith(("import_module", "__import__")) and isinstance(arg, ast.Constant):
                found.add(str(arg.value))
    return found


def _is_backend_or_drop(name: str) -> bool:
    top = name.split(".")[0]
    if top in BACKEND_PACKAGES or top.startswith("moe_ep_drop") or top in DROP_TOP_LEVEL:
        return True
    if name.startswith("moe_ep.backends."):
        return not (name == CONTRACT or name.startswith(CONTRACT + "."))
    return False


def _closure(start: str) -> dict[str, set[str]]:
    """moe_ep modules reachable from `start` through executed imports -> what each imports.

    Importing `a.b.c` runs `a/__init__` and `a/b/__init__` too, so parents are included.
    """
    seen: dict[str, set[str]] = {}
    todo = [start]
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod in seen or not mod.startswith("moe_ep"):
                continue
            path = _module_path(mod)
            if path is None:
                continue  # `from pkg import name` where name is an attribute
            seen[mod] = _imports(path, mod)
            todo.extend(seen[mod])
    return seen


def test_parser_sees_relative_and_dynamic_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "moe_ep" / "x"
    pkg.mkdir(parents=True)
    f = pkg / "mod.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ..backends import portable\n"
        "import importlib\n"
        "def f():\n    importlib.import_module('moe_ep_sm90')\n"
        "if TYPE_CHECKING:\n    import moe_ep_sm100\n"
    )
    names = _imports(f, "moe_ep.x.mod")
    assert "moe_ep.backends.portable" in names and "moe_ep_sm90" in names
    assert "moe_ep_sm100" not in names
    assert _is_backend_or_drop("moe_ep.backends.portable")
    assert _is_backend_or_drop("moe_ep_drop_sm90_pull.shim")
    assert not _is_backend_or_drop(CONTRACT) and not _is_backend_or_drop("moe_ep.errors")


@pytest.mark.parametrize("module", RUNTIME_MODULES)
def test_runtime_imports_no_backend_or_drop(module: str) -> None:
    reached = _closure(module)
    assert module in reached
    bad = {
        f"{importer} imports {name}"
        for importer, names in reached.items()
        for name in names
        if _is_backend_or_drop(name)
    }
    assert not bad, sorted(bad)
    # only the backend contract may be reached under moe_ep.backends
    assert {m for m in reached if m.startswith("moe_ep.backends.")} <= {CONTRACT}


def test_core_never_imports_backend_packages_or_drops_by_name() -> None:
    files = sorted((CORE / "moe_ep").rglob("*.py"))
    assert len(files) > 5
    offenders = []
    for path in files:
        rel = path.relative_to(CORE).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for name in _imports(path, module):
            top = name.split(".")[0]
            if top in BACKEND_PACKAGES or top.startswith("moe_ep_drop"):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, offenders


def _loaded_modules(rank: int, world_size: int) -> list[str]:
    import moe_ep.launch
    import moe_ep.runtime  # noqa: F401

    return sorted(sys.modules)


@pytest.mark.multirank
def test_importing_runtime_loads_no_backend_or_drop() -> None:
    from moe_ep.launch import spawn_local

    (loaded,) = spawn_local(_loaded_modules, 1, timeout_s=90)
    assert "moe_ep.runtime" in loaded
    assert not [m for m in loaded if _is_backend_or_drop(m)]

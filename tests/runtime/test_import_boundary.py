"""Import boundaries of core, read from import statements (ast), plus one live check.

- Imports in core flow one way, bottom to top, with no exception: no module imports a
  module of a higher layer (`import_graph.LAYERS`), and no modules import each other in a
  circle, counting the imports made for type checkers too.
- No backend package's modules import each other in a circle (type-only imports counted).
- No module under packages/moe-ep-core names `moe_ep_sm90`, `moe_ep_sm100` or a drop
  package: backends are reached through entry points only.
- `moe_ep.runtime` and the modules it is built from import no backend (`moe_ep.backends.*`,
  `moe_ep_sm90`, `moe_ep_sm100`) and no drop, directly or through other moe_ep modules.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import import_graph
import pytest
from import_graph import (
    BACKEND_PACKAGES,
    backend_graph,
    backend_names,
    circles,
    core_graph,
    imported_names,
    layer_of,
    reverse_edges,
)

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "packages/moe-ep-core/src"
RUNTIME_MODULES = [
    "moe_ep.runtime",
    "moe_ep.config",
    "moe_ep.device",
    "moe_ep.env",
    "moe_ep.spawn",
]
# Drop packages (`moe_ep_drop_*`) and the generic top-level names the CuTe DSL drops import
# from their src/ (see shared notes on the drops): none may be imported by core by name.
DROP_TOP_LEVEL = ("src", "common", "moe_nvfp4_swapab", "moe_hopper_fp8", "moe_mxfp8_glu")


def _module_path(name: str) -> Path | None:
    base = CORE.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_backend_or_drop(name: str) -> bool:
    top = name.split(".")[0]
    if top in BACKEND_PACKAGES or top.startswith("moe_ep_drop") or top in DROP_TOP_LEVEL:
        return True
    return name.startswith("moe_ep.backends.") or name == "moe_ep.backends"


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
            seen[mod] = imported_names(path, mod)
            todo.extend(seen[mod])
    return seen


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / import_graph.CORE_SRC / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


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
    names = imported_names(f, "moe_ep.x.mod")
    assert "moe_ep.backends.portable" in names and "moe_ep_sm90" in names
    assert "moe_ep_sm100" not in names
    assert "moe_ep_sm100" in imported_names(f, "moe_ep.x.mod", type_only=True)
    assert _is_backend_or_drop("moe_ep.backends.portable")
    assert _is_backend_or_drop("moe_ep_drop_sm90_pull.shim")
    assert not _is_backend_or_drop("moe_ep.contract") and not _is_backend_or_drop("moe_ep.errors")


def test_checks_catch_planted_reverse_edges_circles_and_backend_names(tmp_path: Path) -> None:
    """The rules below fail on a tree that breaks them (so an empty result means something)."""
    root = _write(
        tmp_path,
        {
            "moe_ep/__init__.py": "",
            "moe_ep/errors.py": "",
            # contract (bottom) reaching up into the runtime, for type checkers only
            "moe_ep/contract.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from moe_ep.runtime import Runtime\n"
            ),
            "moe_ep/runtime/__init__.py": "from moe_ep.contract import X\n",
            # two registry modules importing each other, lazily
            "moe_ep/registry/__init__.py": "",
            "moe_ep/registry/a.py": "def f():\n    from moe_ep.registry import b\n",
            "moe_ep/registry/b.py": "from . import a\n",
            "moe_ep/cli/__init__.py": "import moe_ep_sm100.x\n",
        },
    )
    graph = core_graph(root, type_only=True)
    assert reverse_edges(graph) == ["moe_ep.contract -> moe_ep.runtime"]
    assert [c for c in circles(graph) if "moe_ep.registry.a" in c] == [
        ["moe_ep.registry.a", "moe_ep.registry.b"]
    ]
    assert ["moe_ep.contract", "moe_ep.runtime"] in circles(graph)
    assert reverse_edges(core_graph(root)) == []  # without the type-only import
    assert backend_names(root) == ["moe_ep.cli: moe_ep_sm100.x"]


def test_every_core_module_has_a_layer() -> None:
    unplaced = [m for m in core_graph(ROOT) if layer_of(m) == len(import_graph.LAYERS)]
    assert not unplaced, f"add these to import_graph.LAYERS: {unplaced}"


@pytest.mark.parametrize("type_only", [False, True], ids=["executed", "with-type-only"])
def test_core_imports_flow_one_way(type_only: bool) -> None:
    graph = core_graph(ROOT, type_only=type_only)
    assert len(graph) > 20
    assert reverse_edges(graph) == []
    assert circles(graph) == []


@pytest.mark.parametrize("type_only", [False, True], ids=["executed", "with-type-only"])
@pytest.mark.parametrize("package", BACKEND_PACKAGES)
def test_backend_package_has_no_import_circle(package: str, type_only: bool) -> None:
    graph = backend_graph(ROOT, package, type_only=type_only)
    assert len(graph) > 5
    assert circles(graph) == []


def test_backend_circle_check_sees_function_level_imports(tmp_path: Path) -> None:
    """A circle closed by an import inside a function (as a lazy import) still counts."""
    src = tmp_path / import_graph.BACKEND_SRC["moe_ep_sm90"]
    (src / "moe_ep_sm90").mkdir(parents=True)
    (src / "moe_ep_sm90" / "__init__.py").write_text("")
    (src / "moe_ep_sm90" / "a.py").write_text("from moe_ep_sm90.b import x\n")
    (src / "moe_ep_sm90" / "b.py").write_text("def x():\n    from moe_ep_sm90 import a\n")
    graph = backend_graph(tmp_path, "moe_ep_sm90")
    assert circles(graph) == [["moe_ep_sm90.a", "moe_ep_sm90.b"]]


def test_core_never_imports_backend_packages_or_drops_by_name() -> None:
    assert backend_names(ROOT) == []


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
    assert not [m for m in reached if m.startswith("moe_ep.backends")]


def _loaded_modules(rank: int, world_size: int) -> list[str]:
    for module in RUNTIME_MODULES:
        importlib.import_module(module)
    return sorted(sys.modules)


@pytest.mark.multirank
def test_importing_runtime_loads_no_backend_or_drop() -> None:
    from moe_ep.spawn import spawn_local

    (loaded,) = spawn_local(_loaded_modules, 1, timeout_s=90)
    assert "moe_ep.runtime" in loaded
    assert not [m for m in loaded if _is_backend_or_drop(m)]

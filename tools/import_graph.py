"""moe-ep core's import graph, read from import statements (ast), and its layering rules.

`tests/runtime/test_import_boundary.py` enforces the rules (and that no backend package's
modules import each other in a circle); `python tools/import_graph.py [ROOT]` prints the
tree's measures (files, lines, largest file, import circles, reverse edges) for any checkout,
e.g. an older commit extracted with `git archive`.

Layers, bottom first: a module may import its own layer and the ones below, never above.
A module's layer is that of the longest prefix in `LAYERS` naming it.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

CORE_SRC = Path("packages/moe-ep-core/src")
BACKEND_SRC = {
    "moe_ep_sm90": Path("packages/moe-ep-backends-sm90/src"),
    "moe_ep_sm100": Path("packages/moe-ep-backends-sm100/src"),
}
BACKEND_PACKAGES = tuple(BACKEND_SRC)

LAYERS: tuple[tuple[str, ...], ...] = (
    # the plain data, the errors and the kernel contract: what every other module speaks
    (
        "moe_ep.errors",
        "moe_ep.compat",
        "moe_ep.types",
        "moe_ep.placement",
        "moe_ep.placement_balance",
        "moe_ep.placement_weights",
        "moe_ep.placement_routing",
        "moe_ep.contract",
        "moe_ep.checks",
    ),
    # process-wide utilities that know no MoE semantics beyond the types
    (
        "moe_ep.env",
        "moe_ep.config",
        "moe_ep.device",
        "moe_ep.cache_trust",
        "moe_ep.drop_tree",
        "moe_ep.quant",
        "moe_ep.spawn",
    ),
    ("moe_ep.runtime",),
    ("moe_ep.registry",),
    ("moe_ep.backends",),
    # the tuning cache and knob grids: they know the portable kernel's thread rule
    ("moe_ep.tuning",),
    ("moe_ep.oracle", "moe_ep.layer"),
    ("moe_ep.cli", "moe_ep"),
)


def module_name(path: Path, src: Path) -> str:
    rel = path.relative_to(src).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def imported_names(path: Path, module: str, *, type_only: bool = False) -> set[str]:
    """Absolute names of every module `path` imports (any nesting; TYPE_CHECKING blocks
    only with `type_only`), plus string literals given to importlib.import_module /
    __import__."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    type_checking: set[int] = set()
    for node in ast.walk(tree):
        if not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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


def package_modules(src: Path, package: str) -> dict[str, Path]:
    """Module name -> file for every module of `package` under the source root `src`."""
    return {module_name(p, src): p for p in sorted((src / package).rglob("*.py"))}


def core_modules(root: Path) -> dict[str, Path]:
    return package_modules(root / CORE_SRC, "moe_ep")


def package_graph(src: Path, package: str, *, type_only: bool = False) -> dict[str, set[str]]:
    """module of `package` -> the modules of `package` it imports (`from pkg import name`
    counts as an edge to `pkg.name` when that is a module, else to `pkg`); `type_only` adds
    the imports made for type checkers only."""
    modules = package_modules(src, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for name in imported_names(path, module, type_only=type_only):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    # `from a import b` adds both `a` and `a.b`; keep only the most specific one
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not any(u.startswith(t + ".") for u in targets)}
    return graph


def core_graph(root: Path, *, type_only: bool = False) -> dict[str, set[str]]:
    """`package_graph` of moe_ep (core)."""
    return package_graph(root / CORE_SRC, "moe_ep", type_only=type_only)


def backend_graph(root: Path, package: str, *, type_only: bool = False) -> dict[str, set[str]]:
    """`package_graph` of one backend package (`BACKEND_SRC`)."""
    return package_graph(root / BACKEND_SRC[package], package, type_only=type_only)


def layer_of(module: str) -> int:
    best, best_len = len(LAYERS), -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def reverse_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a lower layer up into a higher one."""
    return sorted(
        f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)
    )


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def backend_names(root: Path) -> list[str]:
    """`path: name` for every core import naming a backend or drop package."""
    offenders = []
    for module, path in core_modules(root).items():
        for name in imported_names(path, module):
            top = name.split(".")[0]
            if top in BACKEND_PACKAGES or top.startswith("moe_ep_drop"):
                offenders.append(f"{module}: {name}")
    return sorted(offenders)


def tree_measures(root: Path) -> dict[str, object]:
    files = sorted((root / "packages").glob("*/src/**/*.py"))
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in files}
    largest = max(sizes, key=sizes.__getitem__)
    graph = core_graph(root)
    typed = core_graph(root, type_only=True)
    backend_circles = [
        c
        for package in BACKEND_PACKAGES
        if (root / BACKEND_SRC[package] / package).is_dir()
        for c in circles(backend_graph(root, package, type_only=True))
    ]
    return {
        "product files": len(sizes),
        "product lines": sum(sizes.values()),
        "largest file": f"{largest} ({sizes[largest]})",
        "import circles": len(circles(graph)),
        "import circles (with type-only imports)": len(circles(typed)),
        "reverse edges": len(reverse_edges(graph)),
        "reverse edges (with type-only imports)": len(reverse_edges(typed)),
        "backend package import circles (with type-only imports)": len(backend_circles),
    }


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else ".").resolve()
    for key, value in tree_measures(root).items():
        print(f"{key}: {value}")
    graph = core_graph(root, type_only=True)
    for component in circles(graph):
        print("circle (type-only imports included):", " <-> ".join(component))
    for edge in reverse_edges(graph):
        print("reverse edge (type-only imports included):", edge)
    for package in BACKEND_PACKAGES:
        if (root / BACKEND_SRC[package] / package).is_dir():
            for component in circles(backend_graph(root, package, type_only=True)):
                print(f"{package} circle (type-only imports included):", " <-> ".join(component))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

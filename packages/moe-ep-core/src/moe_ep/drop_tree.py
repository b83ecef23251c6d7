"""A vendored drop's upstream tree: found, checked against the drop's lock, then imported.

Every drop's shim (`vendor/<drop>/shim/<package>/__init__.py`) builds one `UpstreamTree` for
its drop; this module is the one copy of that logic (drops depend on moe-ep-core already).
Core itself never imports a drop: this module only reads the tree a shim points it at.

- Where: `vendor/<drop>/src/` in a checkout (beside `vendor.lock.json`), `<package>/_upstream/`
  in a built wheel (beside `_upstream.lock.json`, the lock the wheel was built from). A
  checkout never uses an `_upstream/`: one there is planted or stale and is refused.
- Before first use the whole tree is checked against the lock: every file's sha256, nothing
  missing, nothing extra, no symlinks. Bytecode caches (`__pycache__/*.pyc`) are skipped
  because nothing reads them (below). Modes are not compared (installers may change them).
- Python modules are imported through a path hook that covers the tree: each module is
  compiled from its source bytes, whose sha256 is checked against the lock as they are read.
  No bytecode is read or written, and `linecache` gets the same verified lines, so code that
  re-reads its source (the CuTe DSL's AST preprocessor, through `inspect`) sees them too.
- Files read by other tools (`src_dir()`, `source_files()`: the CUDA sources nvcc compiles)
  are verified when the tree is first used in the process, not again when they are read.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import linecache
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import CodeType, ModuleType

from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError

__all__ = ["CHECKOUT_LOCK", "WHEEL_LOCK", "DropUnavailableError", "UpstreamTree"]

CHECKOUT_LOCK = "vendor.lock.json"
WHEEL_LOCK = "_upstream.lock.json"
_SHOWN = 5  # problems named in a refusal


class DropUnavailableError(MoeEpUnavailableError):
    """The drop's upstream tree is missing, does not match its lock, or cannot be imported."""


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _is_bytecode(rel: str) -> bool:
    parts = rel.split("/")
    return len(parts) > 1 and parts[-2] == "__pycache__" and rel.endswith(".pyc")


def _lock_files(lock: Path, drop: str) -> dict[str, str]:
    """`{path relative to the tree: sha256}` of a lock made for `drop`."""
    doc = json.loads(lock.read_text(encoding="utf-8"))
    if doc["drop"] != drop:
        raise ValueError(f"it is the lock of drop {doc['drop']!r}")
    return {str(f["path"]): str(f["sha256"]) for f in doc["files"]}


def _tree_problems(root: Path, files: dict[str, str]) -> list[str]:
    """How the files under `root` differ from the lock's (sorted; empty when they match)."""
    problems: list[str] = []
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath)
        for name in [d for d in dirnames if (base / d).is_symlink()]:
            problems.append(f"symlink {(base / name).relative_to(root).as_posix()}")
            dirnames.remove(name)
        for name in filenames:
            path = base / name
            rel = path.relative_to(root).as_posix()
            seen.add(rel)
            if path.is_symlink() or not path.is_file():
                problems.append(f"not a regular file {rel}")
            elif _is_bytecode(rel):
                continue
            elif rel not in files:
                problems.append(f"extra {rel}")
            elif _sha256(path.read_bytes()) != files[rel]:
                problems.append(f"modified {rel}")
    problems += [f"missing {rel}" for rel in files if rel not in seen]
    return sorted(problems)


def _within(entry: str, root: Path) -> bool:
    try:
        real = Path(entry or ".").resolve()
    except (OSError, RuntimeError, TypeError):
        return False
    return real == root or root in real.parents


def _loader_class(
    drop: str, root: Path, files: dict[str, str]
) -> type[importlib.machinery.SourceFileLoader]:
    class VerifiedSourceLoader(importlib.machinery.SourceFileLoader):
        """Compiles a module of the tree from source bytes checked against the lock as they
        are read; never reads or writes bytecode."""

        def _verified(self) -> bytes:
            real = Path(self.path).resolve()
            if not _within(str(real), root):
                raise ImportError(f"drop {drop!r}: {self.path} is outside its tree {root}")
            rel = real.relative_to(root).as_posix()
            want = files.get(rel)
            if want is None:
                raise ImportError(f"drop {drop!r}: {rel} is not in its lock; refusing to import it")
            data = real.read_bytes()
            if _sha256(data) != want:
                raise ImportError(
                    f"drop {drop!r}: {rel} does not match its lock (sha256 {_sha256(data)}, "
                    f"locked {want}); refusing to import it"
                )
            return data

        def get_source(self, fullname: str) -> str:
            return importlib.util.decode_source(self._verified())

        def get_code(self, fullname: str) -> CodeType:
            data = self._verified()
            lines = importlib.util.decode_source(data).splitlines(keepends=True)
            # mtime None: linecache never re-reads the file for this entry.
            linecache.cache[self.path] = (len(data), None, lines, self.path)
            code: CodeType = compile(data, self.path, "exec", dont_inherit=True)
            return code

    return VerifiedSourceLoader


def _path_hook(
    root: Path, loader: type[importlib.machinery.SourceFileLoader]
) -> Callable[[str], importlib.machinery.FileFinder]:
    def hook(entry: str) -> importlib.machinery.FileFinder:
        if not _within(entry, root):
            raise ImportError("not in the drop's tree")  # the next path hook takes it
        return importlib.machinery.FileFinder(entry, (loader, [".py"]))

    return hook


class UpstreamTree:
    """One drop's upstream tree, as its shim offers it (see the module docstring)."""

    def __init__(self, drop: str, package_dir: Path, *, python_tree: bool) -> None:
        self._drop = drop
        self._sync = f"uv run tools/vendor.py sync {drop}"
        self._package_dir = package_dir
        self._python_tree = python_tree
        self._verified: tuple[Path, dict[str, str]] | None = None
        self._active: Path | None = None

    def _locate(self) -> tuple[Path, Path, str]:
        """`(tree, lock, what fixes a mismatch)`; `DropUnavailableError` when there is none."""
        upstream = self._package_dir / "_upstream"
        checkout = self._package_dir.parents[1]
        if (checkout / CHECKOUT_LOCK).is_file():
            if os.path.lexists(upstream):
                raise DropUnavailableError(
                    f"drop {self._drop!r}: {upstream} exists in a checkout, where only "
                    f"{checkout / 'src'} is used; only a built wheel carries _upstream/, so this "
                    "one is planted or stale: remove it"
                )
            if (checkout / "src").is_dir():
                return checkout / "src", checkout / CHECKOUT_LOCK, f"run `{self._sync} --force`"
        elif upstream.is_dir():
            if not (self._package_dir / WHEEL_LOCK).is_file():
                raise DropUnavailableError(
                    f"drop {self._drop!r}: {upstream} has no {WHEEL_LOCK} beside it, so its "
                    "bytes cannot be verified (the drop's wheel build puts one there); "
                    "reinstall the package"
                )
            return upstream, self._package_dir / WHEEL_LOCK, "reinstall the package"
        raise DropUnavailableError(
            f"vendored drop {self._drop!r} is not materialized; run `{self._sync}`"
        )

    def _tree(self) -> tuple[Path, dict[str, str]]:
        """The verified tree's root and its lock's `{path: sha256}` (checked once)."""
        if self._verified is None:
            root, lock, fix = self._locate()
            try:
                files = _lock_files(lock, self._drop)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise DropUnavailableError(
                    f"drop {self._drop!r}: {lock} is unreadable or malformed ({exc}); {fix}"
                ) from None
            problems = _tree_problems(root, files)
            if problems:
                more = f" and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
                raise DropUnavailableError(
                    f"drop {self._drop!r}: {root} does not match {lock.name}: "
                    f"{', '.join(problems[:_SHOWN])}{more}; {fix}"
                )
            self._verified = (root.resolve(), files)
        return self._verified

    def is_materialized(self) -> bool:
        """True when the upstream tree is present (in the wheel or in the checkout)."""
        try:
            self._locate()
        except DropUnavailableError:
            return False
        return True

    def availability(self) -> tuple[bool, str]:
        """`(True, tree path)` when the tree is present and matches its lock, else
        `(False, reason naming the fix)`."""
        try:
            return True, str(self._tree()[0])
        except DropUnavailableError as exc:
            return False, str(exc)

    def src_dir(self) -> Path:
        """Root of the verified upstream tree.

        Raises:
            DropUnavailableError: the tree is missing or does not match the lock (the
                message names the fix).
        """
        return self._tree()[0]

    def source_files(self, pattern: str = "**/*") -> list[Path]:
        """Files of the tree (those in the lock) matching `pattern` (e.g. `**/*.cu`), sorted."""
        root, files = self._tree()
        return sorted(p for p in root.glob(pattern) if p.relative_to(root).as_posix() in files)

    def top_level_packages(self) -> tuple[str, ...]:
        """Names of the top-level Python packages in the tree (e.g. `common`, `src`), namespace
        packages (a directory of modules without `__init__.py`) included."""
        files = self._tree()[1]
        return tuple(
            sorted({p.split("/")[0] for p in files if p.count("/") == 1 and p.endswith(".py")})
        )

    def active_src(self) -> Path | None:
        """The tree this drop made importable, or None when it has not been activated."""
        return self._active

    def activate(self) -> Path:
        """Make the tree's top-level packages importable, through verified loading only;
        idempotent.

        Warning:
            The CuTe DSL drops share top-level names (`common`, `src`, ...), so of drops that
            share one only one may be active per process, and activation cannot be undone. A
            drop whose names no active drop holds (a module set that imports another drop's
            packages) activates beside it.

        Raises:
            DropUnavailableError: the tree is missing or does not match the lock.
            MoeEpUsageError: an active drop holds one of this drop's top-level names, a
                top-level name is already imported (not through this shim, so not
                verified), or this drop is not a Python tree.
        """
        root, files = self._tree()
        if self._active is not None:
            return self._active
        if not self._python_tree:
            raise MoeEpUsageError(
                f"drop {self._drop!r} is not a Python tree; use src_dir() / source_files() instead"
            )
        mine = set(self.top_level_packages())
        for name, module in list(sys.modules.items()):
            other = getattr(module, "active_src", None)
            if name.startswith("moe_ep_drop_") and "." not in name and callable(other) and other():
                shared = mine & set(module.top_level_packages())
                if shared:
                    raise MoeEpUsageError(
                        f"drop {self._drop!r} cannot activate: {name} is already active in this "
                        f"process and holds the same top-level package names "
                        f"({', '.join(sorted(shared))}); use one of these drops per process"
                    )
        for name in sorted(mine):
            if name in sys.modules:
                origin = getattr(sys.modules[name], "__file__", None)
                raise MoeEpUsageError(
                    f"drop {self._drop!r} cannot activate: top-level module {name!r} is already "
                    f"imported (from {origin!r}), not through this drop's verified loader"
                )
        sys.path_hooks.insert(0, _path_hook(root, _loader_class(self._drop, root, files)))
        for entry in [e for e in sys.path_importer_cache if _within(e, root)]:
            del sys.path_importer_cache[entry]  # finders made before the hook: not verified
        sys.path.insert(0, str(root))
        self._active = root
        return root

    def import_src_module(self, module: str) -> ModuleType:
        """Activate the drop and import `module` from its tree (e.g. `"common.moe_utils"`).

        Raises:
            DropUnavailableError: the tree is missing or does not match the lock, or importing
                `module` failed (the cause is chained and named in the message).
        """
        self.activate()
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            raise DropUnavailableError(
                f"drop {self._drop!r}: importing {module!r} failed: {exc}"
            ) from exc

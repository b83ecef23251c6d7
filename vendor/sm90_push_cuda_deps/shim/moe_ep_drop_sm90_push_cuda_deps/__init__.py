"""Shim of a vendored drop: the only code that touches the drop's upstream `src/`.

Drop: `sm90_push_cuda_deps`.
Headers and common sources the sm90 push CUDA drop includes from outside its kernel_src:
FlashInfer tvm_ffi_utils.h and layout.cuh, TRT-LLM nv_internal common + deep_gemm headers, the
CUTLASS/CuTe headers they reach (203 files, exactly the nvcc -M closure).

`src/` is byte-verbatim upstream, materialized by
`uv run tools/vendor.py sync sm90_push_cuda_deps` and never committed.
An editable (workspace) install reads `vendor/sm90_push_cuda_deps/src/`;
a built wheel ships the same tree as `moe_ep_drop_sm90_push_cuda_deps/_upstream/`.
Importing this package never touches `src/`: callers ask `availability()` first, or catch
`DropUnavailableError`.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError

__all__ = [
    "DROP_NAME",
    "PYTHON_TREE",
    "SYNC_COMMAND",
    "DropUnavailableError",
    "activate",
    "active_src",
    "availability",
    "import_src_module",
    "is_materialized",
    "source_files",
    "src_dir",
    "top_level_packages",
]

DROP_NAME = "sm90_push_cuda_deps"
SYNC_COMMAND = f"uv run tools/vendor.py sync {DROP_NAME}"
# True when src/ holds Python packages imported as top-level names (the CuTe DSL drops).
PYTHON_TREE = False

_HERE = Path(__file__).resolve().parent
_active: Path | None = None


class DropUnavailableError(MoeEpUnavailableError):
    """The drop's upstream tree is not materialized, or cannot be imported here."""


def _candidates() -> tuple[Path, ...]:
    # A built wheel carries `_upstream/`; a workspace checkout has vendor/<drop>/src/ beside
    # the drop's vendor.lock.json (the marker keeps an unrelated `src/` from being taken).
    checkout = _HERE.parents[1]
    in_repo = (checkout / "src",) if (checkout / "vendor.lock.json").is_file() else ()
    return (_HERE / "_upstream", *in_repo)


def _find() -> Path | None:
    for path in _candidates():
        if path.is_dir() and any(path.iterdir()):
            return path
    return None


def is_materialized() -> bool:
    """True when the upstream tree is present (in the wheel or in the checkout)."""
    return _find() is not None


def availability() -> tuple[bool, str]:
    """`(True, path)` when the tree is present, else `(False, reason naming the fix)`."""
    path = _find()
    if path is None:
        return False, f"vendored drop {DROP_NAME!r} is not materialized; run `{SYNC_COMMAND}`"
    return True, str(path)


def src_dir() -> Path:
    """Root of the upstream tree.

    Raises:
        DropUnavailableError: the tree is not materialized (the message names the sync command).
    """
    path = _find()
    if path is None:
        raise DropUnavailableError(availability()[1])
    return path


def source_files(pattern: str = "**/*") -> list[Path]:
    """Files of the upstream tree matching `pattern` (e.g. `**/*.cu`), sorted."""
    root = src_dir()
    return sorted(p for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts)


def top_level_packages() -> tuple[str, ...]:
    """Names of the top-level Python packages in the tree (e.g. `common`, `src`)."""
    root = src_dir()
    return tuple(sorted(p.name for p in root.iterdir() if (p / "__init__.py").is_file()))


def active_src() -> Path | None:
    """The tree this drop put on `sys.path`, or None when it has not been activated."""
    return _active


def _other_active_drop() -> str | None:
    for name, module in list(sys.modules.items()):
        if name.startswith("moe_ep_drop_") and "." not in name and name != __name__:
            other = getattr(module, "active_src", None)
            if callable(other) and other() is not None:
                return name
    return None


def activate() -> Path:
    """Put the tree first on `sys.path` so its generic top-level packages import; idempotent.

    Warning:
        The CuTe DSL drops share top-level names (`common`, `src`, ...), so only one drop may
        be active per process, and activation cannot be undone.

    Raises:
        DropUnavailableError: the tree is not materialized.
        MoeEpUsageError: another drop is active, a top-level name is already imported from
            elsewhere, or this drop is not a Python tree.
    """
    global _active
    root = src_dir()
    if _active is not None:
        return _active
    if not PYTHON_TREE:
        raise MoeEpUsageError(
            f"drop {DROP_NAME!r} is not a Python tree; use src_dir() / source_files() instead"
        )
    other = _other_active_drop()
    if other is not None:
        raise MoeEpUsageError(
            f"drop {DROP_NAME!r} cannot activate: {other} is already active in this process "
            "(the drops share top-level package names; use one drop per process)"
        )
    for name in top_level_packages():
        module = sys.modules.get(name)
        origin = getattr(module, "__file__", None) if module is not None else None
        if module is not None and (origin is None or root not in Path(origin).resolve().parents):
            raise MoeEpUsageError(
                f"drop {DROP_NAME!r} cannot activate: top-level module {name!r} is already "
                f"imported from {origin!r}, not from {root}"
            )
    sys.path.insert(0, str(root))
    _active = root
    return root


def import_src_module(module: str) -> ModuleType:
    """Activate the drop and import `module` from it (e.g. `"common.moe_utils"`).

    Raises:
        DropUnavailableError: the tree is missing, or importing `module` failed (the cause
            is chained and named in the message).
    """
    activate()
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DropUnavailableError(
            f"drop {DROP_NAME!r}: importing {module!r} failed: {exc}"
        ) from exc

"""Files `add` writes for a new drop member: pyproject, build hook, shim, .gitignore, prose."""

from __future__ import annotations

import textwrap

__all__ = ["GITIGNORE", "HATCH_BUILD", "render_body", "render_pyproject", "render_shim"]

GITIGNORE = """\
# Upstream bytes are materialized by `uv run tools/vendor.py sync`; never committed.
/src/
/.vendor-tmp-*/
"""

HATCH_BUILD = '''\
"""Hatch build hook: a standard wheel ships src/ as `<upstream-package>/_upstream/`.

Exactly the files vendor.lock.json lists are shipped, each checked against its sha256, so a
wheel never carries bytes the lock does not vouch for. Editable installs ship nothing: the
shim then reads the in-repo `src/`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface


class UpstreamTreeHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel" or version == "editable":
            return
        root = Path(self.root)
        package = str(self.config["upstream-package"])
        lock = json.loads((root / "vendor.lock.json").read_text(encoding="utf-8"))
        src = root / "src"
        sync = f"uv run tools/vendor.py sync {lock['drop']}"
        if not src.is_dir():
            raise RuntimeError(f"{src} is missing: run `{sync}` before building this wheel")
        for entry in lock["files"]:
            path = src / entry["path"]
            if not path.is_file():
                raise RuntimeError(f"{path} is missing: run `{sync}`")
            if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
                raise RuntimeError(f"{path} differs from vendor.lock.json: run `{sync} --force`")
            build_data["force_include"][str(path)] = f"{package}/_upstream/{entry['path']}"
'''

_SHIM = '''\
"""Shim of a vendored drop: the only code that touches the drop's upstream `src/`.

Drop: `@@NAME@@`.
@@DESCRIPTION@@

`src/` is byte-verbatim upstream, materialized by
`uv run tools/vendor.py sync @@NAME@@` and never committed.
An editable (workspace) install reads `vendor/@@NAME@@/src/`;
a built wheel ships the same tree as `@@PKG@@/_upstream/`.
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

DROP_NAME = "@@NAME@@"
SYNC_COMMAND = f"uv run tools/vendor.py sync {DROP_NAME}"
# True when src/ holds Python packages imported as top-level names (the CuTe DSL drops).
PYTHON_TREE = @@PYTHON_TREE@@

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
'''


def render_shim(name: str, package: str, description: str, python_tree: bool) -> str:
    """The shim `__init__.py` for a drop."""
    return (
        _SHIM.replace("@@NAME@@", name)
        .replace("@@PKG@@", package)
        .replace("@@DESCRIPTION@@", textwrap.fill(description.rstrip(".") + ".", width=96))
        .replace("@@PYTHON_TREE@@", "True" if python_tree else "False")
    )


def render_pyproject(distribution: str, package: str, description: str, spdx: str) -> str:
    """The member's pyproject: static metadata, shim package, src/ shipped by the build hook."""
    license_expr = spdx if "Apache-2.0" in spdx.split() else f"Apache-2.0 AND ({spdx})"
    return f"""\
# Workspace member for one vendored drop: the shim (ours) plus src/ (upstream, git-ignored,
# materialized by `uv run tools/vendor.py sync`). See docs/vendoring.md.
[project]
name = "{distribution}"
version = "0.1.0"
description = "{description}"
requires-python = ">=3.11,<3.13"
# The shim is Apache-2.0; the shipped upstream tree carries its own license (see VENDOR.md).
license = "{license_expr}"
dependencies = [
    # MoeEpUnavailableError / MoeEpUsageError for the shim's errors.
    "moe-ep-core",
]

[build-system]
requires = ["hatchling>=1.25"]
build-backend = "hatchling.build"

[tool.hatch.build.targets.wheel]
packages = ["shim/{package}"]

# Ships src/ inside the wheel as {package}/_upstream/ (standard builds only).
[tool.hatch.build.targets.wheel.hooks.custom]
path = "hatch_build.py"
upstream-package = "{package}"

[tool.hatch.build.targets.sdist]
# src/ is git-ignored but belongs in the sdist, so that the wheel built from it ships it.
ignore-vcs = true
include = ["/shim", "/src", "/patches", "/VENDOR.md", "/vendor.lock.json", "/hatch_build.py"]
exclude = ["__pycache__", "*.pyc"]

[tool.uv.sources]
moe-ep-core = {{ workspace = true }}
"""


def render_body(name: str) -> str:
    """Prose skeleton after the front matter."""
    return f"""\
# Vendored drop `{name}`

What this drop is, why it is vendored, and what the shim adapts.

## Provenance

Where the bytes come from and what the upstream's own notes say about their origin.

## Updating

`uv run tools/vendor.py outdated {name}`, then `uv run tools/vendor.py sync {name} --to <rev>`
and `uv run tools/vendor.py verify {name}`. No edit of any kind under `src/`.
"""

"""Files `add` writes for a new drop member: pyproject, build hook, shim, .gitignore, prose.

These are the one source of every drop's generated files: the build hook (`HATCH_BUILD`) and
the shim (`shim_files`: a per-drop `__init__.py` over core's `moe_ep.drop_tree`, which holds
the logic every drop shares) are written by `add`, and `lint` and tests/vendor check that each
drop's copies are exactly what this module generates. A drop depends on moe-ep-core only,
never on another drop.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable

__all__ = [
    "GITIGNORE",
    "HATCH_BUILD",
    "is_python_tree",
    "render_body",
    "render_pyproject",
    "render_shim",
    "shim_files",
]

GITIGNORE = """\
# Upstream bytes are materialized by `uv run tools/vendor.py sync`; never committed.
/src/
/.vendor-tmp-*/
"""

HATCH_BUILD = '''\
"""Hatch build hook: a standard wheel ships src/ as `<upstream-package>/_upstream/`.

Exactly the files vendor.lock.json lists are shipped, each checked against its sha256, so a
wheel never carries bytes the lock does not vouch for; the lock itself goes beside them as
`<upstream-package>/_upstream.lock.json`, and the shim checks the installed tree against it
before first use. Editable installs ship nothing: the shim then reads the in-repo `src/`.
Generated from tools/vendorlib/templates.py (HATCH_BUILD); the same in every drop.
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
        lock_path = root / "vendor.lock.json"
        lock = json.loads(lock_path.read_text(encoding="utf-8"))
        src = root / "src"
        sync = f"uv run tools/vendor.py sync {lock['drop']}"
        if not src.is_dir():
            raise RuntimeError(f"{src} is missing: run `{sync}` before building this wheel")
        real_src = src.resolve()
        for entry in lock["files"]:
            path = src / entry["path"]
            if real_src not in path.resolve().parents:
                raise RuntimeError(f"vendor.lock.json lists {entry['path']!r}, outside src/")
            if path.is_symlink() or not path.is_file():
                raise RuntimeError(f"{path} is missing or not a regular file: run `{sync}`")
            if hashlib.sha256(path.read_bytes()).hexdigest() != entry["sha256"]:
                raise RuntimeError(f"{path} differs from vendor.lock.json: run `{sync} --force`")
            build_data["force_include"][str(path)] = f"{package}/_upstream/{entry['path']}"
        build_data["force_include"][str(lock_path)] = f"{package}/_upstream.lock.json"
'''

_SHIM_INIT = '''\
"""Shim of the vendored drop `@@NAME@@`:@@BREAK@@the only code that touches its upstream tree.

@@DESCRIPTION@@

The tree is byte-verbatim upstream. In a checkout it is `vendor/@@NAME@@/src/`,
materialized by `uv run tools/vendor.py sync @@NAME@@` and never committed;
a built wheel ships it as `@@PKG@@/_upstream/`.
It is checked against the drop's lock before first use, and only bytes the lock vouches for
are imported (`moe_ep.drop_tree`).
Importing this package never touches the tree: callers ask `availability()` first, or catch
`DropUnavailableError`.
"""

from __future__ import annotations

from pathlib import Path

from moe_ep.drop_tree import DropUnavailableError, UpstreamTree

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
# True when the tree holds Python packages imported as top-level names (the CuTe DSL drops).
PYTHON_TREE = @@PYTHON_TREE@@

_TREE = UpstreamTree(DROP_NAME, Path(__file__).resolve().parent, python_tree=PYTHON_TREE)

is_materialized = _TREE.is_materialized
availability = _TREE.availability
src_dir = _TREE.src_dir
source_files = _TREE.source_files
top_level_packages = _TREE.top_level_packages
active_src = _TREE.active_src
activate = _TREE.activate
import_src_module = _TREE.import_src_module
'''


def is_python_tree(paths: Iterable[str]) -> bool:
    """True when a top-level directory of the tree holds Python modules: a package
    (`<name>/__init__.py`) or a namespace package (`<name>/<module>.py`, no `__init__.py`)."""
    return any(p.count("/") == 1 and p.endswith(".py") for p in paths)


def render_shim(name: str, package: str, description: str, python_tree: bool) -> str:
    """The shim `__init__.py` for a drop."""
    # The summary line breaks only where a long drop name would take it past 100 columns.
    summary = _SHIM_INIT.split("\n", 1)[0].replace("@@NAME@@", name).replace("@@BREAK@@", " ")
    return (
        _SHIM_INIT.replace("@@BREAK@@", " " if len(summary) <= 100 else "\n")
        .replace("@@NAME@@", name)
        .replace("@@PKG@@", package)
        .replace("@@DESCRIPTION@@", textwrap.fill(description.rstrip(".") + ".", width=96))
        .replace("@@PYTHON_TREE@@", "True" if python_tree else "False")
    )


def shim_files(name: str, package: str, description: str, python_tree: bool) -> dict[str, str]:
    """Every file of a drop's shim package, by name: `__init__.py` and `py.typed` (the shared
    logic is `moe_ep.drop_tree`, in core)."""
    return {
        "__init__.py": render_shim(name, package, description, python_tree),
        "py.typed": "",
    }


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
# LICENSE covers the shim; licenses/ holds the upstream texts, NOTICE says which
# upstream files each covers (add both before building: docs/vendoring.md, "Adding a drop").
license-files = ["LICENSE", "NOTICE", "licenses/*.txt"]
dependencies = [
    # MoeEpUnavailableError / MoeEpUsageError for the shim's errors.
    "moe-ep-core",
]

[build-system]
# >= 1.27: PEP 639 `license-files`.
requires = ["hatchling>=1.27"]
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
include = [
    "/shim",
    "/src",
    "/patches",
    "/VENDOR.md",
    "/vendor.lock.json",
    "/hatch_build.py",
    "/LICENSE",
    "/NOTICE",
    "/licenses",
]
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

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

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

"""Shim of the vendored drop `sm90_pull_nvfp4`: the only code that touches its upstream tree.

FlashInfer's sm90 (Hopper) NVFP4 specialization of the pull-style CuTe DSL MXFP4 mega-MoE kernel
(Sm90MegaMoESwapABNvfp4Fp8Kernel; E2M1 weights with folded E4M3 K16 scales, fp8 activations);
imports moe_hopper_fp8 and moe_nvfp4_swapab from the sm90_pull_cutedsl drop.

The tree is byte-verbatim upstream. In a checkout it is `vendor/sm90_pull_nvfp4/src/`,
materialized by `uv run tools/vendor.py sync sm90_pull_nvfp4` and never committed;
a built wheel ships it as `moe_ep_drop_sm90_pull_nvfp4/_upstream/`.
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

DROP_NAME = "sm90_pull_nvfp4"
SYNC_COMMAND = f"uv run tools/vendor.py sync {DROP_NAME}"
# True when the tree holds Python packages imported as top-level names (the CuTe DSL drops).
PYTHON_TREE = True

_TREE = UpstreamTree(DROP_NAME, Path(__file__).resolve().parent, python_tree=PYTHON_TREE)

is_materialized = _TREE.is_materialized
availability = _TREE.availability
src_dir = _TREE.src_dir
source_files = _TREE.source_files
top_level_packages = _TREE.top_level_packages
active_src = _TREE.active_src
activate = _TREE.activate
import_src_module = _TREE.import_src_module

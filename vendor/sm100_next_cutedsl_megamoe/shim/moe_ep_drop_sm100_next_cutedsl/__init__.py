"""Shim of the vendored drop `sm100_next_cutedsl_megamoe`:
the only code that touches its upstream tree.

sm100 (Blackwell) CuTe DSL block-scaled swap-AB mega-MoE kernels of the provider export:
standard inference (BlackwellInferenceMegaMoE; nvfp4, mxfp8, mxfp8 x mxfp4) and GenPhase
(BlackwellInferenceGenphaseMegaMoE).

The tree is byte-verbatim upstream. In a checkout it is `vendor/sm100_next_cutedsl_megamoe/src/`,
materialized by `uv run tools/vendor.py sync sm100_next_cutedsl_megamoe` and never committed;
a built wheel ships it as `moe_ep_drop_sm100_next_cutedsl/_upstream/`.
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

DROP_NAME = "sm100_next_cutedsl_megamoe"
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

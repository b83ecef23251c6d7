"""The `sm90_pull_cutedsl` drop as both pull kernels (fp8 `moe_hopper_fp8`, bf16
`moe_hopper_bf16`) reach it: its reference, its module loader, what its kernels need on
this machine (`pull_availability`) and their shared-workspace combine region.

A CuTe DSL drop puts its `src/` first on `sys.path` and imports generic top-level names
(`common`, `src`, ...), so only one such drop can be active per process; each kernel's
`upstream` module is the single place that kernel touches the drop's classes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from moe_ep.backends.support import drop_access
from moe_ep.backends.support.availability import check_availability
from moe_ep.backends.support.cutedsl.launch_glue import combine_region as _combine_region
from moe_ep.backends.support.drop_access import DropRef
from moe_ep.backends.support.launch_args import LaunchGeometry

__all__ = [
    "COMBINE_REGION",
    "PULL_DROP",
    "combine_region",
    "drop_src_module",
    "pull_availability",
]

PULL_DROP = DropRef(import_name="moe_ep_drop_sm90_pull", dist="moe-ep-drop-sm90-pull-cutedsl")

drop_src_module = partial(drop_access.drop_src_module, needed_by=__name__)
"""`drop_src_module(drop, name)`: module `name` of the drop's `src/`, through its shim."""

_PACKAGES = (
    ("cutlass", "nvidia-cutlass-dsl"),
    ("cuda.bindings", "cuda-bindings"),
    ("nvshmem", "nvshmem4py-cu13"),
)
_FLOORS = (("nvidia-cutlass-dsl", "4.8.0", "the sm90_pull_cutedsl drop (flashinfer-python 0.7.4)"),)
"""Version floors of the drop's release (its wheel's `Requires-Dist`), refused below."""

COMBINE_REGION = "unreduced_expert_output"
"""The drop kernels' shared-workspace region of per-(token, slot) bf16 combine cells
`[T, k, H]`, which their separate top-k reduce sums (`fc2_in_kernel_topk_reduce=False`)."""


def pull_availability() -> tuple[bool, str]:
    """(True, "") or (False, every reason): a Hopper GPU (sm_90a), cutlass-dsl >= 4.8,
    cuda-bindings, nvshmem4py and the drop installed and materialized."""
    return check_availability(
        capability=(9, 0),
        arch_label="Hopper, sm_90a",
        packages=_PACKAGES,
        floors=_FLOORS,
        drop=PULL_DROP,
    )


def combine_region(kernel: Any, g: LaunchGeometry) -> tuple[int, int]:
    """(byte offset, byte count) of a pull kernel's bf16 combine cells `[T, k, H]` in its
    shared workspace; `RuntimeError` if its region table no longer has them so."""
    return _combine_region(kernel, COMBINE_REGION, g, owner="moe_ep_sm90")

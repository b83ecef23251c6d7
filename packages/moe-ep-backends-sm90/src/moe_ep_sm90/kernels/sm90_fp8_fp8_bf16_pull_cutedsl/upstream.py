"""The pull kernel's upstream bytes: the `sm90_pull_cutedsl` drop
(`vendor/sm90_pull_cutedsl/src/moe_hopper_fp8/`), reached only through its package
`__init__` (never its `src/`).

A CuTe DSL drop puts its `src/` first on `sys.path` and imports generic top-level names
(`common`, `src`, ...), so only one such drop can be active per process; loading one here
does that, and `load_pull_api` is the single place this package touches the drop's kernel
classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from moe_ep.backends.support import drop_access
from moe_ep.backends.support.drop_access import DropRef

__all__ = ["PULL_DROP", "PullKernelApi", "drop_src_module", "load_pull_api"]

PULL_DROP = DropRef(import_name="moe_ep_drop_sm90_pull", dist="moe-ep-drop-sm90-pull-cutedsl")

drop_src_module = partial(drop_access.drop_src_module, needed_by=__name__)
"""`drop_src_module(drop, name)`: module `name` of the drop's `src/`, through its shim."""


@dataclass(frozen=True)
class PullKernelApi:
    """What the backend needs from the pull drop, as returned by its shim."""

    native_kernel: type
    swap_ab_kernel: type
    sym_buffer_host: type
    sf_padding_block: int
    e8m0_sf_vec_size: int


def load_pull_api() -> PullKernelApi:
    """The pull drop's kernel classes and ABI constants (imports cutlass and the drop)."""
    kernels = drop_src_module(PULL_DROP, "moe_hopper_fp8.megamoe_kernel_fp8")
    consts = drop_src_module(PULL_DROP, "common.megamoe_constants")
    sym = drop_src_module(PULL_DROP, "src.sym_buffer")
    return PullKernelApi(
        native_kernel=kernels.Sm90MegaMoEFp8Kernel,
        swap_ab_kernel=kernels.Sm90MegaMoESwapABFp8Kernel,
        sym_buffer_host=sym.SymBufferHost,
        sf_padding_block=int(consts.SfPaddingBlock),
        e8m0_sf_vec_size=int(consts.Fp8E8M0SfVecSize),
    )

"""The two sm90 drops, reached only through their package `__init__` (never their `src/`).

A CuTe DSL drop puts its `src/` first on `sys.path` and imports generic top-level names
(`common`, `src`, ...), so only one such drop can be active per process; loading one here
does that, and `load_pull_api` is the single place this package touches the pull drop's
kernel classes.
"""

from __future__ import annotations

from functools import partial

from moe_ep.backends.support import drops as support_drops
from moe_ep.backends.support.hardware import DropRef
from moe_ep_sm90.pull_args import PullKernelApi

__all__ = ["PULL_DROP", "PUSH_DROP", "drop_src_module", "load_pull_api"]

PULL_DROP = DropRef(import_name="moe_ep_drop_sm90_pull", dist="moe-ep-drop-sm90-pull-cutedsl")
PUSH_DROP = DropRef(import_name="moe_ep_drop_sm90_push", dist="moe-ep-drop-sm90-push-cuda")


drop_src_module = partial(support_drops.drop_src_module, needed_by="moe_ep_sm90.drops")
"""`drop_src_module(drop, name)`: module `name` of the drop's `src/`, through its shim."""


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

"""The pull kernel's upstream bytes: the `sm90_pull_cutedsl` drop
(`vendor/sm90_pull_cutedsl/src/moe_hopper_fp8/`), reached only through its package
`__init__` (never its `src/`); `load_pull_api` is the single place this kernel touches the
drop's kernel classes (the drop reference and loader: `moe_ep_sm90.common.pull_drop`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_ep_sm90.common.pull_drop import PULL_DROP, drop_src_module

__all__ = ["PULL_DROP", "PullKernelApi", "drop_src_module", "load_pull_api"]


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

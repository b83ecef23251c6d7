"""The MXFP4 x FP8 pull kernel's upstream bytes: the `sm90_pull_cutedsl` drop
(`vendor/sm90_pull_cutedsl/src/moe_hopper_fp8/`, `Sm90MegaMoESwapABMxfp4Fp8Kernel`), reached
only through its package; `load_mxfp4_api` is the single place this kernel touches the
drop's classes (the loader and availability: `moe_ep_sm90.common.pull_drop`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_ep_sm90.common.pull_drop import PULL_DROP, drop_src_module

__all__ = ["Mxfp4KernelApi", "load_mxfp4_api"]


@dataclass(frozen=True)
class Mxfp4KernelApi:
    """What the backend needs from the drop for the MXFP4 kernel (swap-AB only)."""

    swap_ab_kernel: type
    sym_buffer_host: type
    sf_padding_block: int
    e8m0_sf_vec_size: int


def load_mxfp4_api() -> Mxfp4KernelApi:
    """The drop's MXFP4 kernel class and ABI constants (imports cutlass and the drop)."""
    kernels = drop_src_module(PULL_DROP, "moe_hopper_fp8.megamoe_kernel_fp8")
    consts = drop_src_module(PULL_DROP, "common.megamoe_constants")
    sym = drop_src_module(PULL_DROP, "src.sym_buffer")
    return Mxfp4KernelApi(
        swap_ab_kernel=kernels.Sm90MegaMoESwapABMxfp4Fp8Kernel,
        sym_buffer_host=sym.SymBufferHost,
        sf_padding_block=int(consts.SfPaddingBlock),
        e8m0_sf_vec_size=int(consts.Fp8E8M0SfVecSize),
    )

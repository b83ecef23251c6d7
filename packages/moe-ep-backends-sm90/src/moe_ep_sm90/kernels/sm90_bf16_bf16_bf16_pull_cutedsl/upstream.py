"""The bf16 pull kernel's upstream bytes: the `sm90_pull_cutedsl` drop
(`vendor/sm90_pull_cutedsl/src/moe_hopper_bf16/`, new in flashinfer-python 0.7.4), reached
only through its package `__init__` (never its `src/`); `load_bf16_pull_api` is the single
place this kernel touches the drop's kernel classes (the drop reference and loader:
`moe_ep_sm90.common.pull_drop`).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_ep_sm90.common.pull_drop import PULL_DROP, drop_src_module

__all__ = ["BF16_KERNEL_MODULE", "Bf16PullKernelApi", "load_bf16_pull_api"]

BF16_KERNEL_MODULE = "moe_hopper_bf16.megamoe_kernel_bf16"


@dataclass(frozen=True)
class Bf16PullKernelApi:
    """What the backend needs from the drop's bf16 kernel, as returned by its shim."""

    native_kernel: type
    swap_ab_kernel: type
    sym_buffer_host: type


def load_bf16_pull_api() -> Bf16PullKernelApi:
    """The drop's bf16 kernel classes and its `SymBufferHost` (imports cutlass and the drop)."""
    kernels = drop_src_module(PULL_DROP, BF16_KERNEL_MODULE)
    sym = drop_src_module(PULL_DROP, "src.sym_buffer")
    return Bf16PullKernelApi(
        native_kernel=kernels.Sm90MegaMoEBf16Kernel,
        swap_ab_kernel=kernels.Sm90MegaMoESwapABBf16Kernel,
        sym_buffer_host=sym.SymBufferHost,
    )

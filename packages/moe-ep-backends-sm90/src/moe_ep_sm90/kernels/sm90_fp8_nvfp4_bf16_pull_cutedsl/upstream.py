"""The NVFP4 x FP8 pull kernel's upstream bytes: FlashInfer's `Sm90MegaMoESwapABNvfp4Fp8Kernel`
(`vendor/sm90_pull_nvfp4/src/shim/nvfp4_kernels.py`), a subclass of the `sm90_pull_cutedsl`
drop's `Sm90MegaMoESwapABMxfp4Fp8Kernel` (`vendor/sm90_pull_cutedsl/src/moe_hopper_fp8/`).

The NVFP4 modules import the pull drop's top-level packages (`moe_hopper_fp8`,
`moe_nvfp4_swapab`, `src`), so the pull drop is activated first and the NVFP4 drop (top-level
name `shim` only) beside it; both load through their shims' verified loaders
(`moe_ep.drop_tree`). `load_nvfp4_api` is the single place this kernel touches either drop's
classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_ep.backends.support.drop_access import DropRef
from moe_ep_sm90.common.pull_drop import PULL_DROP, drop_src_module, pull_availability
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.upstream import Mxfp4KernelApi

__all__ = ["NVFP4_DROP", "Nvfp4KernelApi", "load_nvfp4_api", "nvfp4_availability"]

NVFP4_DROP = DropRef(import_name="moe_ep_drop_sm90_pull_nvfp4", dist="moe-ep-drop-sm90-pull-nvfp4")


@dataclass(frozen=True)
class Nvfp4KernelApi(Mxfp4KernelApi):
    """The MXFP4 kernel's API with the NVFP4 class as `swap_ab_kernel` (it takes the MXFP4
    kernel's constructor arguments and two more) and its conversion layout."""

    conversion_layout: type
    """The drop's `Nvfp4ConversionLayout` (its `kperm` must match our weights and staging)."""

    def conversion(self, kperm: int) -> Any:
        """The kernel's conversion layout for `kperm`, every other field its default."""
        return self.conversion_layout(kperm=kperm)


def load_nvfp4_api() -> Nvfp4KernelApi:
    """The NVFP4 kernel class, its conversion layout and the pull drop's ABI constants
    (imports cutlass and both drops: the pull drop first)."""
    consts = drop_src_module(PULL_DROP, "common.megamoe_constants")
    sym = drop_src_module(PULL_DROP, "src.sym_buffer")
    kernels = drop_src_module(NVFP4_DROP, "shim.nvfp4_kernels")
    policy = drop_src_module(NVFP4_DROP, "shim.nvfp4_policy")
    return Nvfp4KernelApi(
        swap_ab_kernel=kernels.Sm90MegaMoESwapABNvfp4Fp8Kernel,
        conversion_layout=policy.Nvfp4ConversionLayout,
        sym_buffer_host=sym.SymBufferHost,
        sf_padding_block=int(consts.SfPaddingBlock),
        e8m0_sf_vec_size=int(consts.Fp8E8M0SfVecSize),
    )


def nvfp4_availability() -> tuple[bool, str]:
    """(True, "") or (False, every reason): the pull kernels' needs (`pull_availability`)
    and the NVFP4 drop installed and materialized."""
    ok, why = pull_availability()
    reasons = [why] if why else []
    mine = NVFP4_DROP.reason()
    if mine:
        reasons.append(mine)
    return (ok and not mine, "; ".join(reasons))

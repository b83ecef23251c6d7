"""The mxfp8 kernel's upstream bytes: `moe_mxfp8_glu` of the `sm100_cutedsl_megamoe` drop
(`vendor/sm100_cutedsl_megamoe/src/moe_mxfp8_glu/`), loaded through the drop's shim."""

from __future__ import annotations

from dataclasses import dataclass

from moe_ep_sm100.common.cutedsl import CUTEDSL_DROP, drop_src_module
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp8_bf16_cutedsl.config import MXFP8_BLOCK

__all__ = ["Mxfp8KernelApi", "load_mxfp8_api"]


@dataclass(frozen=True)
class Mxfp8KernelApi:
    """What the backend needs from the sm100 drop for the mxfp8 kernel."""

    kernel: type
    token_padding_block: int
    sf_padding_block: int
    sym_buffer_host: type


def load_mxfp8_api() -> Mxfp8KernelApi:
    """The mxfp8 kernel class and ABI constants, through the drop's shim (imports cutlass)."""
    kernel = drop_src_module(CUTEDSL_DROP, "moe_mxfp8_glu.megamoe_kernel_mxfp8")
    requant = drop_src_module(CUTEDSL_DROP, "moe_mxfp8_glu.mxfp8_col_requant")
    consts = drop_src_module(CUTEDSL_DROP, "common.megamoe_constants")
    sym = drop_src_module(CUTEDSL_DROP, "src.sym_buffer")
    if int(consts.Mxfp8BlockSize) != MXFP8_BLOCK:
        raise RuntimeError(
            f"the drop's Mxfp8BlockSize is {consts.Mxfp8BlockSize}, moe_ep_sm100 assumes "
            f"{MXFP8_BLOCK}"
        )
    # The kernel's token-axis requant takes only its TokenPaddingBlocks (128, 256); the
    # drop's runner pads expert token segments to the 128-row scale atom, so do we.
    token_padding = int(consts.SfPaddingBlock)
    allowed = tuple(requant.Mxfp8ColRequant.TokenPaddingBlocks)
    if token_padding not in allowed:
        raise RuntimeError(
            f"the drop's SfPaddingBlock {token_padding} is not a token padding block its "
            f"Mxfp8ColRequant accepts {allowed}"
        )
    return Mxfp8KernelApi(
        kernel=kernel.Sm100MegaMoEMxfp8Kernel,
        token_padding_block=token_padding,
        sf_padding_block=int(consts.SfPaddingBlock),
        sym_buffer_host=sym.SymBufferHost,
    )

"""The nvfp4 kernel's upstream bytes: `moe_nvfp4_swapab` of the `sm100_cutedsl_megamoe` drop
(`vendor/sm100_cutedsl_megamoe/src/moe_nvfp4_swapab/`), loaded through the drop's shim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_ep_sm100.common.cutedsl import CUTEDSL_DROP, drop_src_module

__all__ = ["Nvfp4KernelApi", "load_nvfp4_api"]


@dataclass(frozen=True)
class Nvfp4KernelApi:
    """What the backend needs from the sm100 drop for the nvfp4 kernel."""

    kernel: type
    token_padding_block: int
    sf_padding_block: int
    combine_format_bf16: Any
    sym_buffer_host: type


def load_nvfp4_api() -> Nvfp4KernelApi:
    """The nvfp4 kernel class and ABI constants, through the drop's shim (imports cutlass)."""
    kernel = drop_src_module(CUTEDSL_DROP, "moe_nvfp4_swapab.megamoe_kernel")
    epilogue = drop_src_module(CUTEDSL_DROP, "moe_nvfp4_swapab.epilogue_refactor")
    consts = drop_src_module(CUTEDSL_DROP, "common.megamoe_constants")
    comm = drop_src_module(CUTEDSL_DROP, "src.token_comm")
    sym = drop_src_module(CUTEDSL_DROP, "src.sym_buffer")
    return Nvfp4KernelApi(
        kernel=kernel.Sm100MegaMoEKernel,
        token_padding_block=int(epilogue.SwapABSwigluFp4Epilogue._EpilogueTokenTileSize),
        sf_padding_block=int(consts.SfPaddingBlock),
        combine_format_bf16=comm.CombineFormat.parse("bf16"),
        sym_buffer_host=sym.SymBufferHost,
    )

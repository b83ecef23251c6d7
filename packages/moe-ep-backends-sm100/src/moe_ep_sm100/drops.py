"""The sm100 CuTe DSL drop, reached only through its package `__init__` (never its `src/`).

The drop puts its `src/` first on `sys.path` and imports generic top-level names (`common`,
`src`, ...), so it cannot share a process with the sm90 pull drop.
"""

from __future__ import annotations

from functools import partial

from moe_ep.backends.support import drops as support_drops
from moe_ep.backends.support.hardware import DropRef
from moe_ep_sm100 import mxfp8_args
from moe_ep_sm100.nvfp4_args import Nvfp4KernelApi

__all__ = ["CUTEDSL_DROP", "drop_src_module", "load_mxfp8_api", "load_nvfp4_api"]

CUTEDSL_DROP = DropRef(
    import_name="moe_ep_drop_sm100_cutedsl", dist="moe-ep-drop-sm100-cutedsl-megamoe"
)


drop_src_module = partial(support_drops.drop_src_module, needed_by="moe_ep_sm100.drops")
"""`drop_src_module(drop, name)`: module `name` of the drop's `src/`, through its shim."""


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


def load_mxfp8_api() -> mxfp8_args.Mxfp8KernelApi:
    """The mxfp8 kernel class and ABI constants, through the drop's shim (imports cutlass)."""
    kernel = drop_src_module(CUTEDSL_DROP, "moe_mxfp8_glu.megamoe_kernel_mxfp8")
    epilogue = drop_src_module(CUTEDSL_DROP, "moe_nvfp4_swapab.epilogue")
    consts = drop_src_module(CUTEDSL_DROP, "common.megamoe_constants")
    sym = drop_src_module(CUTEDSL_DROP, "src.sym_buffer")
    if int(consts.Mxfp8BlockSize) != mxfp8_args.MXFP8_BLOCK:
        raise RuntimeError(
            f"the drop's Mxfp8BlockSize is {consts.Mxfp8BlockSize}, moe_ep_sm100 assumes "
            f"{mxfp8_args.MXFP8_BLOCK}"
        )
    return mxfp8_args.Mxfp8KernelApi(
        kernel=kernel.Sm100MegaMoEMxfp8Kernel,
        token_padding_block=int(epilogue.EpilogueTokenTile),
        sf_padding_block=int(consts.SfPaddingBlock),
        sym_buffer_host=sym.SymBufferHost,
    )

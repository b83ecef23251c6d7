"""The kernel's upstream bytes: `BlackwellInferenceMegaMoE` of the `sm100_next_cutedsl_megamoe`
drop (`vendor/sm100_next_cutedsl_megamoe/src/sources/`), loaded through the drop's shim, and
the constants moe-ep relies on, checked against the drop."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from moe_ep.backends.support import drop_access
from moe_ep.backends.support.drop_access import DropRef
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
    MAX_TOKENS_PER_RANK,
    MAX_TOP_K,
    MAX_WORLD_SIZE,
    MX_BLOCK,
)

__all__ = ["NEXT_DROP", "QUANT_KIND", "Mxfp4KernelApi", "load_api"]

NEXT_DROP = DropRef(
    import_name="moe_ep_drop_sm100_next_cutedsl", dist="moe-ep-drop-sm100-next-cutedsl-megamoe"
)

QUANT_KIND = "mxfp4_mxfp8"
"""The drop's `QuantKind` of this kernel: e2m1 weights (MMA A under swap-AB), e4m3 activations."""

_module = partial(drop_access.drop_src_module, NEXT_DROP, needed_by=__name__)


@dataclass(frozen=True)
class Mxfp4KernelApi:
    """What the backend needs from the drop: the kernel class, its descriptor types, its
    combine-format parser (`CombineFormat.parse`) and the peer-pointer map."""

    kernel: type
    problem_desc: type
    impl_desc: type
    operand_major_k: Any
    combine_format: Any
    symmetric_buffer_host: type

    def sym_buffer_host(
        self, *, base_addr: int, offsets: tuple[int, ...], rank_idx: int, num_max_ranks: int
    ) -> Any:
        """The drop's `SymmetricBufferHost` under the keyword names core's launch glue and
        compile fakes use for the peer map (`base_addr`, `offsets`, `rank_idx`,
        `num_max_ranks`)."""
        return self.symmetric_buffer_host(
            base_address=base_addr, offsets=tuple(offsets), rank=rank_idx, max_ranks=num_max_ranks
        )


def load_api() -> Mxfp4KernelApi:
    """The kernel class and the drop types its arguments need (imports cutlass).

    Raises `RuntimeError` when a constant moe-ep assumes (block size 32, E8M0 scales, the
    routing limits in `config`) differs in the drop.
    """
    from cutlass.cute.nvgpu import OperandMajorMode

    quant = _module("sources.quant_def")
    protocol = _module("sources.communication.token_protocol")
    api = _module("sources.api")
    sym = _module("sources.communication.nvlink_domain.symmetric_buffer")
    kind = quant.QuantKind(QUANT_KIND)
    meta = protocol.TokenSrcMetadata
    found = {
        "sf_vec_size": (int(kind.sf_vec_size), MX_BLOCK),
        "scale_format_code (1 = UE8M0)": (int(kind.scale_format_code), 1),
        "TokenSrcMetadata.MAX_TOPK": (int(meta.MAX_TOPK), MAX_TOP_K),
        "TokenSrcMetadata.MAX_RANKS": (int(meta.MAX_RANKS), MAX_WORLD_SIZE),
        "TokenSrcMetadata.MAX_TOKENS": (int(meta.MAX_TOKENS), MAX_TOKENS_PER_RANK),
    }
    for name, (got, want) in found.items():
        if got != want:
            raise RuntimeError(
                f"the drop's {QUANT_KIND} {name} is {got}; moe_ep_sm100 assumes {want}"
            )
    kernels = _module("sources")
    return Mxfp4KernelApi(
        kernel=kernels.BlackwellInferenceMegaMoE,
        problem_desc=api.ProblemDesc,
        impl_desc=api.ImplDesc,
        operand_major_k=OperandMajorMode.K,
        combine_format=quant.CombineFormat.parse,
        symmetric_buffer_host=sym.SymmetricBufferHost,
    )

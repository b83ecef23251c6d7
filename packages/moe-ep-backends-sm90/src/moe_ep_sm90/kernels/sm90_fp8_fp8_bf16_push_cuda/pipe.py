"""One push-protocol pipe: symmetric window, scratch, GEMM resources, and one round.

Warning:
    NEVER RUN ON A GPU. Written from the drop's kernel signatures
    (`a2a/sm90_push_a2a_ops.cu`, `fp8_gemm/fp8_moe_binding.cu`) and FlashInfer's host code for
    them (`push_style_megamoe/shim/{protocol,runner}.py` in the wheel), for one configuration:
    fp8 payload (the dispatch quantizes 1x128), bf16 combine, unfused FC1 (`moe_gemm` into
    bf16, then `sm90_silu_mul_quant_grouped`), no dedup, no grouped combine. What is tested
    on CPU: the window layout (`window`) and the order and arguments of the module
    calls of one round, against recording fakes (`tests/backends/test_sm90_push_pipe.py`).
    The peer checks (single node, NVLink-native atomics between every pair of ranks) run
    before `create` (`peers`, from `kernel._compile`). Not done: FlashInfer's
    fingerprint handshake of the construction arguments.

The window comes from torch's symmetric memory (`torch.distributed._symmetric_memory`:
`empty` + `rendezvous` over the EP group), whose `buffer_ptrs_dev` is the device array of
peer base pointers the kernels take as `peer_bases`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.window import PushLayout

if TYPE_CHECKING:
    import torch

__all__ = ["GemmBuffers", "PushPipe", "PushScratch", "PushWeights"]


@dataclass(frozen=True)
class PushWeights:
    """`w13 [E, 2I, H]` / `w2 [E, H, I]` e4m3 (gate rows then up rows) with 128x128 fp32
    scales `[E, 2I/128, H/128]` / `[E, H/128, I/128]`, on the GPU."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor

    @property
    def intermediate(self) -> int:
        return int(self.w2.shape[-1])


@dataclass
class PushScratch:
    """Local int32 / int64 scratch of the protocol (no dedup, no grouped combine)."""

    round: torch.Tensor
    lc: torch.Tensor
    done: torch.Tensor
    keybase: torch.Tensor
    loff: torch.Tensor
    rows_per_src: torch.Tensor
    cdone_local: torch.Tensor
    offsets: torch.Tensor
    seg_src_base: torch.Tensor
    seg_out_base: torch.Tensor
    pad_base: torch.Tensor
    m_dev: torch.Tensor
    p_dev: torch.Tensor
    next_row: torch.Tensor

    @classmethod
    def allocate(cls, layout: PushLayout, device: torch.device) -> PushScratch:
        import torch

        e, eps = layout.num_local_experts, layout.ep_size

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        def empty(n: int) -> torch.Tensor:
            return torch.empty(n, dtype=torch.int32, device=device)

        return cls(
            round=zeros(1),
            lc=zeros(e * eps),
            done=zeros(e * eps),
            keybase=empty(e * eps),
            loff=empty(layout.token_capacity * layout.top_k),
            rows_per_src=empty(eps),
            cdone_local=empty(eps),
            offsets=torch.empty(e + 1, dtype=torch.int64, device=device),
            seg_src_base=empty(e * eps),
            seg_out_base=empty(e * eps + 1),
            pad_base=empty(e),
            m_dev=zeros(1),
            p_dev=zeros(1),
            next_row=zeros(1),
        )


@dataclass
class GemmBuffers:
    """Rows received on this rank, compacted per expert, through FC1 / SwiGLU / FC2.

    `m_buf = ceil128(m_cap)` rows; scale planes sized `(K/128) * p_ws + 128` with
    `p_ws = ceil32(m_cap + 31 E)` (per-expert padding of the TMA-aligned scale layout).
    """

    a1: torch.Tensor
    sfa1: torch.Tensor
    meta: torch.Tensor
    row_expert: torch.Tensor
    h: torch.Tensor
    a2: torch.Tensor
    sfa2: torch.Tensor
    y: torch.Tensor

    @classmethod
    def allocate(cls, layout: PushLayout, inter: int, device: torch.device) -> GemmBuffers:
        import torch

        m_cap, e, hid = layout.m_cap, layout.num_local_experts, layout.hidden
        m_buf = -(-m_cap // 128) * 128
        p_ws = max(-(-(m_cap + e * 31) // 32) * 32, 1)
        return cls(
            a1=torch.empty(m_buf, hid, dtype=torch.uint8, device=device),
            sfa1=torch.empty((hid // 128) * p_ws + 128, dtype=torch.float32, device=device),
            meta=torch.empty(m_buf, 4, dtype=torch.int32, device=device),
            row_expert=torch.empty(m_buf, dtype=torch.int32, device=device),
            h=torch.empty(m_buf, 2 * inter, dtype=torch.bfloat16, device=device),
            a2=torch.empty(m_buf, inter, dtype=torch.uint8, device=device),
            sfa2=torch.empty((inter // 128) * p_ws + 128, dtype=torch.float32, device=device),
            y=torch.empty(m_buf, hid, dtype=torch.bfloat16, device=device),
        )


@dataclass
class PushPipe:
    """Everything one (config, geometry, device) needs; shared by layers (pooled).

    `a2a` and `gemm_runner` are the loaded TVM-FFI module and `init_moe()` runner; `window`
    the symmetric uint8 buffer, `peer_bases` its device pointer table; `combine` the bf16
    `[T, k, H]` view of the window's combine inbox.
    """

    layout: PushLayout
    inter: int
    a2a: Any
    gemm_runner: Any
    window: torch.Tensor
    peer_bases: int
    scratch: PushScratch
    bufs: GemmBuffers
    workspace: torch.Tensor
    combine: torch.Tensor
    keepalive: list[Any] = field(default_factory=list)
    poisoned: bool = False

    @classmethod
    def create(
        cls, layout: PushLayout, inter: int, *, a2a: Any, gemm: Any, group: Any, device: Any
    ) -> PushPipe:
        """Collective over `group`: allocate and exchange the window, allocate the rest."""
        import torch
        import torch.distributed._symmetric_memory as symm_mem

        window = symm_mem.empty(layout.total_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(window, group)
        window.zero_()
        t, k, hid = layout.token_capacity, layout.top_k, layout.hidden
        combine = (
            window[layout.combine_offset : layout.combine_offset + t * k * hid * 2]
            .view(torch.bfloat16)
            .view(t, k, hid)
        )
        runner = gemm.init_moe()
        ws_bytes = runner.get_moe_workspace_size(
            t * k,
            layout.m_cap,
            max(2 * inter, hid),
            max(hid, inter),
            layout.num_local_experts,
            True,
            True,
        )
        workspace = torch.empty(max(int(ws_bytes), 1), dtype=torch.uint8, device=device)
        runner.configure_workspace(workspace)
        torch.cuda.synchronize(device)
        # No peer may push into this window before every rank has zeroed its own.
        torch.distributed.barrier(group=group)
        return cls(
            layout=layout,
            inter=inter,
            a2a=a2a,
            gemm_runner=runner,
            window=window,
            peer_bases=int(handle.buffer_ptrs_dev),
            scratch=PushScratch.allocate(layout, device),
            bufs=GemmBuffers.allocate(layout, inter, device),
            workspace=workspace,
            combine=combine,
            keepalive=[handle],
        )

    # -- the protocol ---------------------------------------------------------------------
    def _l(self) -> tuple[int, ...]:
        return self.layout.launch_args(self.peer_bases)

    def prepare_jit(self, weights: PushWeights) -> None:
        """Compile (or load from the DeepGEMM disk cache) both GEMMs with empty offsets."""
        import torch

        b, lay = self.bufs, self.layout
        offsets0 = torch.zeros(lay.num_local_experts + 1, dtype=torch.int64, device=b.h.device)
        fp8 = torch.float8_e4m3fn
        self.gemm_runner.moe_gemm(
            b.h,
            b.a1.view(fp8),
            weights.w13,
            offsets0,
            2 * self.inter,
            lay.hidden,
            b.sfa1,
            weights.w13_scales,
            True,
        )
        self.gemm_runner.moe_gemm(
            b.y,
            b.a2.view(fp8),
            weights.w2,
            offsets0,
            lay.hidden,
            self.inter,
            b.sfa2,
            weights.w2_scales,
            True,
        )
        torch.cuda.synchronize(b.h.device)

    def run_round(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        weights: PushWeights,
        output: torch.Tensor,
        num_tokens: int,
    ) -> torch.Tensor:
        """One forward: dispatch `x [T, H]` bf16 / `topk_ids [T, k]` int32 / weights fp32
        (padding rows id -1), run both GEMMs on what arrived, combine back, reduce the first
        `num_tokens` rows into `output [>= num_tokens, H]` bf16. Collective (every rank runs
        one round per forward). On failure the round's abort is published and the pipe is
        poisoned (later rounds raise)."""
        import torch

        if self.poisoned:
            raise RuntimeError("sm90 push pipe is poisoned by an earlier failed round")
        m, s, b, lay = self.a2a, self.scratch, self.bufs, self.layout
        fp8 = torch.float8_e4m3fn
        try:
            self.combine.zero_()
            m.sm90_push_bump_tag(s.round)
            m.sm90_push_wait_acks(*self._l(), s.round)
            m.sm90_push_dispatch_fp8(
                x, topk_ids, topk_weights, *self._l(), s.lc, s.loff, s.done, s.keybase, s.round
            )
            m.sm90_push_wait_prefix(
                *self._l(),
                s.round,
                s.rows_per_src,
                s.offsets,
                s.seg_src_base,
                s.seg_out_base,
                s.pad_base,
                s.m_dev,
                s.p_dev,
                s.next_row,
                lay.m_cap,
            )
            m.sm90_push_compact(
                b.a1,
                b.sfa1,
                b.meta,
                b.row_expert,
                *self._l(),
                s.offsets,
                s.seg_src_base,
                s.seg_out_base,
                s.pad_base,
                s.m_dev,
                s.p_dev,
                s.next_row,
            )
            self.gemm_runner.moe_gemm(
                b.h,
                b.a1.view(fp8),
                weights.w13,
                s.offsets,
                2 * self.inter,
                lay.hidden,
                b.sfa1,
                weights.w13_scales,
                True,
            )
            m.sm90_silu_mul_quant_grouped(
                b.a2,
                b.sfa2,
                b.h,
                s.offsets,
                s.pad_base,
                s.m_dev,
                s.p_dev,
                b.row_expert,
                b.h.shape[0],
            )
            self.gemm_runner.moe_gemm(
                b.y,
                b.a2.view(fp8),
                weights.w2,
                s.offsets,
                lay.hidden,
                self.inter,
                b.sfa2,
                weights.w2_scales,
                True,
            )
            m.sm90_push_combine(
                b.y, b.meta, *self._l(), s.m_dev, s.rows_per_src, s.cdone_local, s.round
            )
            m.sm90_push_wait_combine(*self._l(), s.round)
            m.sm90_combine_reduce(output, *self._l(), num_tokens)
            m.sm90_push_ack(*self._l(), s.round, s.lc, s.done)
        except Exception:
            self.poisoned = True
            # Best effort (a sticky CUDA error may refuse it): tell peers the round is dead.
            with contextlib.suppress(Exception):
                m.sm90_push_publish_abort(*self._l(), s.round)
            raise
        return output

"""The MXFP4 kernel's physical weight tiles (`moe_ep_sm90.common.tile_fold`)
against a thread-by-thread restatement of what the drop's mainloop reads, on CPU.

The reference (`kernel_view`) is written from the layouts' definitions, not from our code:
- the e4m3 WGMMA A fragment (PTX ISA, wgmma `.m64nNk32` A in registers; CuTe's
  `ALayout` of the RS atoms): thread `lane` of warp `w` holds, in value i (0..15), row
  `16w + lane/4 + 8 * (i/4 % 2)`, column `4 * (lane % 4) + i % 4 + 16 * (i / 8)`;
- `ldmatrix` through `make_tiled_copy_A` loads the packed bytes into that fragment as if
  they were e4m3 of K64 per K128 stage (the drop's `make_packed_a_ldsm_views`), and the
  registers are re-read as e2m1 with the nested K mode of its `packed_layout`: fragment
  k-block `2 kk + h` is nibbles `16h .. 16h + 15` of the 16 bytes loaded for `kk`;
- each pair of 32-bit words is converted by the drop's own PTX text of
  `convert_mxfp4_pair_preprocessed_signs`, interpreted here instruction by instruction,
  with the row offsets read through the drop's expanded offset layout
  (`make_expanded_offset_view`) from the stage the cp.async producer fills.
Its output times the per-expert residual must be the portable twin's weight, bit for bit.
The three layouts it restates (`a_fragment`, `packed_nibble`, `offset_byte`) are checked in
turn against CuTe DSL's own (the kernel's tiled MMA and its ldmatrix copy) and the drop's
(`make_packed_a_ldsm_views`, `make_expanded_offset_view`), evaluated while tracing on CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from backend_testing import require_drop, run_fresh_python
from ptx_interp import ptx_op
from sm90_mxfp4_cases import drop_mxfp4_source, wide_weights

from moe_ep import quant
from moe_ep.backends.portable.recipes import Fp8Mxfp4Recipe
from moe_ep.types import MoEWeightPack
from moe_ep_sm90.common.pull_drop import PULL_DROP
from moe_ep_sm90.common.pull_tiles import PULL_GATE_UP_BLOCK
from moe_ep_sm90.common.tile_fold import (
    fold_codes,
    fold_offsets,
    unfold_codes,
    unfold_offsets,
)
from moe_ep_sm90.kernels.sm90_fp8_mxfp4_bf16_pull_cutedsl.layout import (
    prepare_mxfp4_hybrid_weights,
)


def _drop_ptx() -> list[tuple[str, list[str]]]:
    """The instructions of the drop's pair converter, as (opcode, operands)."""
    func = drop_mxfp4_source().split("def convert_mxfp4_pair_preprocessed_signs", 1)[1]
    body = func.split('"{\\n"', 1)[1].split('"}"', 1)[0]  # the asm string's lines
    lines = re.findall(r'"\s*([a-z][a-z0-9.]*) ([^;]*);', body)
    return [(op, [a.strip() for a in args.split(",")]) for op, args in lines if op != ".reg"]


def _run_ptx(ins: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run the drop's converter on int64 tensors of u32 words: inputs $4..$7, outputs $0..$3."""
    regs: dict[str, torch.Tensor] = {f"${4 + j}": v for j, v in enumerate(ins)}

    def val(x: str) -> torch.Tensor | int:
        return int(x, 16) if x.startswith("0x") else (int(x) if x.isdigit() else regs[x])

    for op, args in _drop_ptx():
        d, *src = args
        regs[d] = ptx_op(op, [val(s) for s in src])
    return [regs[f"${j}"] for j in range(4)]


def a_fragment(lane, warp, i):
    """(row, column) of value i of thread `32 warp + lane` in the e4m3 WGMMA A fragment of a
    64 x 32 tile (checked against CuTe's own layout in the trace test below)."""
    return 16 * warp + lane // 4 + 8 * ((i // 4) % 2), 4 * (lane % 4) + i % 4 + 16 * (i // 8)


def packed_nibble(i, h):
    """Value i of e2m1 fragment k-block `2 kk + h`: (byte, nibble) among the 16 bytes
    `ldmatrix` loaded for K32 byte block kk (the drop's `packed_layout`, checked below)."""
    return (i + 16 * h) // 2, (i + 16 * h) % 2


def offset_byte(r, g):
    """Byte of row r's K32 group g in a 16 x 16 offset block (64 rows x 128 columns) as the
    drop's expanded offset view reads it (checked below)."""
    return (r % 16) * 16 + (r // 16 % 4) * 4 + g


def kernel_view(physical: torch.Tensor, folded: torch.Tensor, residual64: torch.Tensor):
    """`[E, N, K]` fp32: what the kernel's WGMMA multiplies, times the epilogue's residual,
    from the physical bytes `[E, N, K/2]` and folded offsets `[E, N/64, K/128, 16, 16]`."""
    e, n, half = (int(d) for d in physical.shape)
    k = 2 * half
    out = torch.full((e, n, k), float("nan"))
    # every (expert, 64-row atom, warp, lane, K128 stage): index grids, value i last
    ex, m64, w, lane, kt = torch.meshgrid(
        torch.arange(e), torch.arange(n // 64), torch.arange(4), torch.arange(32),
        torch.arange(k // 128), indexing="ij",
    )  # fmt: skip
    ex, m64, w, lane, kt = (t.reshape(-1, 1) for t in (ex, m64, w, lane, kt))
    i = torch.arange(16).view(1, 16)
    row, col = a_fragment(lane, w, i)
    row = 64 * m64 + row
    for kk in range(2):  # ldmatrix: the packed K64 bytes as an e4m3 A operand of two K32 blocks
        loaded = physical[ex, row, 64 * kt + 32 * kk + col].long()  # [threads, 16] bytes
        for h in range(2):
            kb = 2 * kk + h  # this fragment k-block (K32 group) of the stage
            byte, nib = packed_nibble(i, h)
            fp4 = (loaded.gather(1, byte.expand_as(loaded)) >> (4 * nib)) & 0xF
            words = [sum(fp4[:, 8 * wd + t] << (4 * t) for t in range(8)) for wd in range(2)]
            # the expanded offset view's byte of the stage's block r // 64, which cp.async
            # filled from folded[e, m64, kt, row, :] (16 bytes a row)
            idx = offset_byte(row[:, [0, 4]] % 64, kb)
            offs = folded[ex, m64, kt, idx // 16, idx % 16].long()
            got = _run_ptx([words[0], words[1], offs[:, 0], offs[:, 1]])
            fp8 = torch.stack([(got[j // 4] >> (8 * (j % 4))) & 0xFF for j in range(16)], dim=-1)
            values = fp8.to(torch.uint8).view(torch.float8_e4m3fn).float()
            out[ex, row, 128 * kt + 32 * kb + col] = values * residual64[ex]
    return out


def _legs(seed: int, e: int = 2, i: int = 128, h: int = 256):
    w13, w2 = wide_weights(seed, e, 2 * i, h), wide_weights(seed + 1, e, h, i)
    return w13, w2, prepare_mxfp4_hybrid_weights(w13, w2)


def test_the_kernels_reading_of_the_folded_tiles_is_the_portable_twins_weights() -> None:
    w13, w2, (fc1, fc2) = _legs(0)
    twin = Fp8Mxfp4Recipe().prepare(MoEWeightPack(w13=w13, w2=w2))
    views = [
        kernel_view(fold_codes(leg.codes), fold_offsets(leg.offsets), leg.residual64)
        for leg in (fc1, fc2)
    ]
    assert torch.equal(quant.deinterleave_gate_up(views[0], PULL_GATE_UP_BLOCK), twin.w13t.mT)
    assert torch.equal(views[1], twin.w2t.mT)


def test_the_reference_has_teeth_the_logical_order_does_not_pass() -> None:
    # The logical codes fed straight in, folded codes with the sign permutation skipped, or
    # unfolded offsets, do not give the weights: the test above can fail.
    _, _, (_, fc2) = _legs(2, e=1)
    want = kernel_view(fold_codes(fc2.codes), fold_offsets(fc2.offsets), fc2.residual64)
    raw = kernel_view(fc2.codes, fold_offsets(fc2.offsets), fc2.residual64)
    unsigned = kernel_view(_swapped_only(fc2.codes), fold_offsets(fc2.offsets), fc2.residual64)
    flat = kernel_view(fold_codes(fc2.codes), _unfolded_as_folded(fc2.offsets), fc2.residual64)
    for bad in (raw, unsigned, flat):
        assert not torch.equal(bad, want)


def _swapped_only(packed: torch.Tensor) -> torch.Tensor:
    """The physical grid positions of `fold_codes` with each code keeping its own sign."""
    from moe_ep_sm90.common import tile_fold

    codes = quant.unpack_e2m1(packed)
    return quant.pack_e2m1(tile_fold._move_codes(codes, to_physical=True).contiguous())


def _unfolded_as_folded(offsets: torch.Tensor) -> torch.Tensor:
    """Offsets in row-major order poured into the folded shape (no fold)."""
    e, n, g = (int(d) for d in offsets.shape)
    return offsets.contiguous().view(e, n // 64, g // 4, 16, 16)


def test_fold_and_unfold_are_inverse_bijections() -> None:
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (3, 128, 96), generator=g, dtype=torch.uint8)
    phys = fold_codes(packed)
    assert phys.shape == packed.shape and phys.dtype == torch.uint8
    assert torch.equal(unfold_codes(phys), packed)
    assert torch.equal(fold_codes(unfold_codes(packed)), packed)
    assert not torch.equal(phys, packed)
    assert torch.equal(torch.sort(quant.unpack_e2m1(phys).flatten() & 7).values,
                       torch.sort(quant.unpack_e2m1(packed).flatten() & 7).values)  # fmt: skip
    offs = torch.randint(1, 13, (3, 128, 8), generator=g, dtype=torch.uint8)
    folded = fold_offsets(offs)
    assert folded.shape == (3, 2, 2, 16, 16) and torch.equal(unfold_offsets(folded), offs)
    # one element by the formula of the module doc
    n = 64 + 37  # row block 1, row 37 = 16 * 2 + 5 in it; K32 group 3 of K128 block 0
    assert folded[1, 1, 0, 5, 4 * 2 + 3] == offs[1, n, 3]


def test_fold_refuses_shapes_off_its_blocks() -> None:
    with pytest.raises(ValueError, match="N % 16 == 0"):
        fold_codes(torch.zeros(1, 24, 16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="N % 64 == 0 and K % 128 == 0"):
        fold_offsets(torch.zeros(1, 64, 2, dtype=torch.uint8))


_PROBE = """
import json, os
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warp, warpgroup
from cutlass.tensor_utils import LayoutEnum
from moe_ep_sm90.common.pull_drop import PULL_DROP, drop_src_module

mx = drop_src_module(PULL_DROP, "moe_hopper_fp8.mxfp4_cutedsl")
out = {}


@cute.jit
def probe():
    k_major = LayoutEnum.ROW_MAJOR.mma_major_mode()
    # the MXFP4 kernel's _create_tiled_mma: e4m3 x e4m3, A from registers
    mma = sm90_utils.make_trivial_tiled_mma(
        cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, k_major, k_major, cutlass.Float32,
        (1, 1, 1), tiler_mn=(64, 64), a_source=warpgroup.OperandSource.RMEM)
    ldsm = cute.make_copy_atom(
        warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), cutlass.Float8E4M3FN)
    copy = cute.make_tiled_copy_A(ldsm, mma)
    tv, dst = mma.tv_layout_A_tiled, copy.layout_dst_tv_tiled
    out["mma"] = [cute.crd2idx((t, v), tv) for t in range(128) for v in range(16)]
    out["ldsm"] = [cute.crd2idx((t, v), dst) for t in range(128) for v in range(16)]
    frag = mma.make_fragment_A(mma.partition_shape_A((128, 128)))
    ptr = cute.make_ptr(cutlass.Float4E2M1FN, 4096, cute.AddressSpace.smem, assumed_align=128)
    smem = cute.make_tensor(ptr, cute.make_layout((128, 128), stride=(128, 1)))
    packed = mx.make_packed_a_ldsm_views(mma, smem, frag, cutlass.Int32(0))[3]
    out["packed"] = [
        cute.crd2idx((i, p, (h, kk)), packed.layout)
        for kk in range(2) for h in range(2) for p in range(2) for i in range(16)
    ]
    # the offsets' smem stage (tile M 128, 2 stages) seen through the expanded view
    raw = cute.make_tensor(
        cute.make_ptr(cutlass.Int8, 0, cute.AddressSpace.smem, assumed_align=16),
        mx.make_offset_smem_layout(128, 2))
    view = mx.make_expanded_offset_view(raw, 128)
    out["offsets"] = [
        cute.crd2idx((m, k, st), view.layout)
        for st in range(2) for m in range(128) for k in range(0, 128, 4)
    ]


cute.compile(probe)
print(json.dumps(out))
"""


def test_the_references_layouts_are_cutes_and_the_drops(tmp_path: Path) -> None:
    # CuTe DSL evaluates these static layouts while tracing (no GPU): the A fragment of the
    # kernel's tiled MMA, where its ldmatrix copy puts the bytes (the same places), and the
    # drop's own nested e2m1 K mode; each must be what `kernel_view` assumes.
    require_drop(PULL_DROP, cutlass=True)
    probe = tmp_path / "probe.py"  # CuTe DSL compiles functions from their source file
    probe.write_text(_PROBE)
    got = run_fresh_python(f"import runpy; runpy.run_path({str(probe)!r})", timeout=240)
    want = []
    for t in range(128):
        for v in range(16):
            row, col = a_fragment(t % 32, t // 32, v)
            want.append(row + 64 * col)  # the 64 x 32 tile, column-major
    assert got["mma"] == want and got["ldsm"] == want
    # packed fp4 offset of (i, p, (h, kk)) in the registers of 16 bytes per (p, kk) block
    want = []
    for kk in range(2):
        for h in range(2):
            for p in range(2):
                for i in range(16):
                    byte, nib = packed_nibble(i, h)
                    want.append(2 * (byte + 16 * p + 32 * kk) + nib)
    assert got["packed"] == want
    # the offset byte of weight (m, k) in a stage: what kernel_view reads from `folded`
    want = [
        st * 512 + (m // 64) * 256 + offset_byte(m % 64, k // 32)
        for st in range(2)
        for m in range(128)
        for k in range(0, 128, 4)
    ]
    assert got["offsets"] == want

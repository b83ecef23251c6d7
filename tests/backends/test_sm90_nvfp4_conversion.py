"""The NVFP4 kernel's e2m1 -> e4m3 conversion reads each 32-bit word of 8 packed codes as the
MXFP4 converter does, so the MXFP4 kernel's physical tiles (`tile_fold.fold_codes`, checked
against that converter in `test_sm90_mxfp4_tile_fold.py`) serve the NVFP4 weights too.

The drop's own PTX (`shim/nvfp4_conversion._nvfp4_super_asm`, generated on CPU in a fresh
process for every K permutation) is interpreted instruction by instruction over its decode
part (selector, PRMT lookup, sign bits), with every LUT row the same table of 8 marked
bytes: output byte t of a word must be the table entry of code t's magnitude (bits 0-2)
with the sign (bit 3) of code `SIGN_HOLDER[t]`, the placement `fold_codes` writes for."""

from __future__ import annotations

import re

import pytest
import torch
from backend_testing import require_drop, run_fresh_python
from ptx_interp import ptx_op

from moe_ep_sm90.common.pull_drop import PULL_DROP
from moe_ep_sm90.common.tile_fold import SIGN_HOLDER
from moe_ep_sm90.kernels.sm90_fp8_nvfp4_bf16_pull_cutedsl.upstream import NVFP4_DROP

_GROUPS = 2  # two K32 fragments per PTX block (kperm 64 converts K64 chunks)
_DECODE_REGS = re.compile(r"^(sel|signs|\$\d+)$")


def _drop_asm(kperm: int) -> str:
    require_drop(PULL_DROP, cutlass=True)
    require_drop(NVFP4_DROP, cutlass=True)
    code = f"""
import json
import moe_ep_drop_sm90_pull as pull, moe_ep_drop_sm90_pull_nvfp4 as nvfp4
pull.activate()
conv = nvfp4.import_src_module("shim.nvfp4_conversion")
policy = nvfp4.import_src_module("shim.nvfp4_policy")
print(json.dumps(conv._nvfp4_super_asm({_GROUPS}, policy.Nvfp4ConversionLayout(kperm={kperm}))))
"""
    return str(run_fresh_python(code))


def _decode(asm: str, words: list[torch.Tensor], lut: tuple[int, int]) -> list[torch.Tensor]:
    """Run the instructions that write `sel`, `signs` or an output `$j` (the decode), with
    the packed words in `$n..$n+4*groups-1` and every `lut<r>` row the same (lo, hi) pair."""
    n = 8 * _GROUPS
    regs: dict[str, torch.Tensor | int] = {f"${n + i}": w for i, w in enumerate(words)}

    def val(x: str) -> torch.Tensor | int:
        if x.startswith("lut"):
            return lut[int(x[3:]) % 2]
        return int(x, 16) if x.startswith("0x") else (int(x) if x.isdigit() else regs[x])

    ops = 0
    for op, args in re.findall(r"^\s*([a-z][a-z0-9.]*) ([^;]*);", asm, flags=re.M):
        d, *src = (a.strip() for a in args.split(","))
        if not _DECODE_REGS.match(d) or op.startswith("ld."):
            continue
        regs[d] = ptx_op(op, [val(s) for s in src])
        ops += 1
    assert ops >= 5 * n, ops  # every output word was decoded
    return [torch.as_tensor(regs[f"${j}"]) for j in range(n)]


@pytest.mark.parametrize("kperm", [0, 32, 64])
def test_each_word_decodes_code_t_with_the_sign_of_sign_holder_t(kperm: int) -> None:
    asm = _drop_asm(kperm)
    marks = [0x11 + 9 * m for m in range(8)]  # distinct, sign bit clear
    lut = (
        sum(b << (8 * i) for i, b in enumerate(marks[:4])),
        sum(b << (8 * i) for i, b in enumerate(marks[4:])),
    )
    gen = torch.Generator().manual_seed(kperm)
    codes = torch.randint(0, 16, (4 * _GROUPS, 256, 8), generator=gen)  # word, sample, code
    words = [sum(codes[w, :, t].long() << (4 * t) for t in range(8)) for w in range(4 * _GROUPS)]
    out = _decode(asm, words, lut)
    table = torch.tensor(marks)
    for w in range(4 * _GROUPS):
        for t in range(8):
            got = (out[2 * w + t // 4] >> (8 * (t % 4))) & 0xFF
            sign = (codes[w, :, SIGN_HOLDER[t]] >> 3) << 7
            assert torch.equal(got, table[codes[w, :, t] & 7] | sign), (kperm, w, t)


def test_the_check_has_teeth_signs_in_place_do_not_pass() -> None:
    asm = _drop_asm(0)
    marks = [0x11 + 9 * m for m in range(8)]
    lut = (
        sum(b << (8 * i) for i, b in enumerate(marks[:4])),
        sum(b << (8 * i) for i, b in enumerate(marks[4:])),
    )
    codes = torch.full((4 * _GROUPS, 1, 8), 0)
    codes[:, :, 0] = 8  # code 0 negative zero: its sign lands on byte 4 (SIGN_HOLDER[4] == 0)
    words = [sum(codes[w, :, t].long() << (4 * t) for t in range(8)) for w in range(4 * _GROUPS)]
    out = _decode(asm, words, lut)
    assert int(out[0][0]) & 0x80 == 0 and int(out[1][0]) & 0x80 == 0x80

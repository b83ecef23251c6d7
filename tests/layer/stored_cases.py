"""Random stored expert weights (codes and scales of every kind) with their values, for the
expert GEMM tests."""

from __future__ import annotations

import torch

from moe_ep import quant
from moe_ep.backends.portable.cpu_fused import StoredWeight

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # OCP MX spec, FP4 E2M1 magnitudes


def random_stored(
    code: str,
    scale: str | None,
    e: int,
    n: int,
    k: int,
    g: torch.Generator,
    block: int | None = None,
) -> tuple[StoredWeight, torch.Tensor]:
    """Random codes (every e4m3 byte but NaN, or every e2m1 nibble) and scales of `scale`
    (fp32 ones from 2^-130 to 2^10: subnormal, ordinary and from 2^8 up, where the AVX2 and
    AVX-512 bodies leave their short e4m3 decode), with their fp32 values by torch's e4m3fn
    conversion and the e2m1 / E8M0 definitions. `block`: elements per scale (default 16, or
    32 for E8M0: the formats')."""
    if code == "e4m3":
        codes = torch.randint(0, 256, (e, n, k), generator=g).to(torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x3C
        stored, value = codes, codes.view(torch.float8_e4m3fn).float()
    else:
        nib = torch.randint(0, 16, (e, n, k), generator=g)
        stored = (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)
        value = torch.tensor(E2M1 + [-v for v in E2M1])[nib]
    if scale is None:
        return StoredWeight(stored.contiguous(), code), value
    block = block or (16 if scale != "e8m0" else 32)
    nb = k // block
    if scale == "fp32":
        s = torch.pow(2.0, torch.randint(-130, 11, (e, n, nb), generator=g).float())
        s = s * (1 + torch.rand(e, n, nb, generator=g))
        factor = s
    elif scale == "e8m0":
        s = torch.randint(100, 140, (e, n, nb), generator=g).to(torch.uint8)
        factor = quant.e8m0_to_float32(s)
    else:
        s = torch.randint(0, 0x7F, (e, n, nb), generator=g).to(torch.uint8)
        factor = s.view(torch.float8_e4m3fn).float()
    w = StoredWeight(stored.contiguous(), code, s.contiguous(), scale, block)  # type: ignore[arg-type]
    return w, value * factor.repeat_interleave(block, -1)

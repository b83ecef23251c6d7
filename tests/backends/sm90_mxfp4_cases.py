"""What the sm90 MXFP4 kernel's tests share: the drop's `mxfp4_cutedsl.py` source (its PTX is
read by the tests, never imported) and weights whose 32-element blocks span many binades."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

DROP_MXFP4_FILE = (
    Path(__file__).resolve().parents[2]
    / "vendor/sm90_pull_cutedsl/src/moe_hopper_fp8/mxfp4_cutedsl.py"
)


def drop_mxfp4_source() -> str:
    """The text of the drop's `mxfp4_cutedsl.py`; skips where the drop is not materialized."""
    if not DROP_MXFP4_FILE.exists():
        pytest.skip("sm90_pull_cutedsl drop not materialized (uv run tools/vendor.py sync --all)")
    return DROP_MXFP4_FILE.read_text()


def wide_weights(seed: int, e: int, n: int, k: int) -> torch.Tensor:
    """`[e, n, k]` bf16 normal weights, each 32-element block scaled by 2**-(0..20): wider
    than the kernel's 11 binades per expert, so its exponent clamp matters."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g)
    binades = torch.randint(0, 21, (e, n, k // 32, 1), generator=g).float()
    return (w.view(e, n, k // 32, 32) * torch.exp2(-binades)).view(e, n, k).bfloat16()

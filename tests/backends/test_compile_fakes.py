"""The compile-only checks' fake tensors have the layout types the launch path's tensors get.

`from_dlpack(t).mark_layout_dynamic(leading_dim)` (the launch path) gives dynamic 32-bit
extents and 64-bit strides; a CuTe DSL kernel is specialised on those widths, so a fake
tensor with other widths would make the compile check build a different kernel.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not installed"
)

CODE = r"""
import json, re
import torch, cutlass
import cutlass.torch as cutlass_torch
from moe_ep.backends.support.launch_args import ArgSpec
from moe_ep.backends.support.cutedsl.compile_fakes import fake_gmem_tensor

def widths(text):
    # '(?,?):(?{i64},1)' or '(?{div=1}, ?{div=1}), (?{i64 div=1}, 1)' -> shape, stride modes
    groups = re.findall(r"\(([^()]*)\)", text)[-2:]
    def mode(tok):
        tok = tok.strip()
        return "1" if tok == "1" else ("i64" if "i64" in tok else "i32")
    return [[mode(t) for t in g.split(",") if t.strip()] for g in groups]

out = []
for shape, lead in (((64, 128), 1), ((4, 64, 128), 2), ((128, 64), 0), ((7,), 0)):
    t = torch.zeros(*shape, dtype=torch.float32)
    if lead != len(shape) - 1:
        t = t.transpose(lead, -1).contiguous().transpose(lead, -1)
    real = cutlass_torch.from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=lead)
    fake = fake_gmem_tensor(ArgSpec("x", shape, "float32", lead), cutlass.Float32)
    out.append({"real": widths(str(real)), "fake": widths(str(fake))})
print(json.dumps(out))
"""


def test_fake_tensors_match_the_launch_paths_layout_types() -> None:
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    cases = json.loads(proc.stdout.strip().splitlines()[-1])
    assert cases[0]["real"] == [["i32", "i32"], ["i64", "1"]]  # what the parsing relies on
    for case in cases:
        assert case["fake"] == case["real"], case

"""Fake sources for the sm90 push module build: the files `build.source_digest` reads, one
comment line each, and the `PushSources` naming them (no real drop needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

GEMM_SOURCES = ("fp8_moe_binding.cu", "fp8_moe_fc1_fused.cuh", "fp8_moe_jit.cuh",
                "fp8_moe_launcher.cuh", "fp8_moe_scheduler.cuh")  # fmt: skip


def push_sources(tmp_path: Path) -> Any:
    """`PushSources` over fake drop and deps trees under `tmp_path` (skips without sm90)."""
    push_build = pytest.importorskip("moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.build")
    drop, deps = tmp_path / "drop", tmp_path / "deps"
    (drop / "fp8_gemm").mkdir(parents=True)
    for name in GEMM_SOURCES:
        (drop / "fp8_gemm" / name).write_text(f"// {name}\n")
    (drop / "a2a").mkdir()
    for name in ("sm90_push_a2a_ops.cu", "sm90_push_a2a.cuh"):
        (drop / "a2a" / name).write_text(f"// {name}\n")
    (deps / "csrc").mkdir(parents=True)
    (deps / "csrc" / "common.h").write_text("// deps\n")
    return push_build.PushSources(
        drop_src=drop,
        deps_src=deps,
        tvm_include=tmp_path,
        tvm_lib_dir=tmp_path,
        cuda_wheel_includes=(),
        cuda_wheel_libs=(),
    )

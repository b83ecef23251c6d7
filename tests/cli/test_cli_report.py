"""`moe-ep kernels` and `moe-ep info` through `main(argv)`, and the console script itself."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from moe_ep.cli import main
from moe_ep.registry import parse_kernel_name

PORTABLE = {
    "any_bf16_bf16_bf16_torch",
    "any_fp8_fp8_bf16_torch",
    "any_mxfp8_mxfp8_bf16_torch",
    "any_nvfp4_nvfp4_bf16_torch",
    "any_fp8_fp4_bf16_torch",
    "any_fp8_mxfp4_bf16_torch",
    "any_fp8_nvfp4_bf16_torch",
    "any_mxfp8_mxfp4_bf16_torch",
}
GPU = {
    "sm100_fp8_fp4_bf16_deepgemm": "deep_gemm_mega",
    "sm100_nvfp4_nvfp4_bf16_cutedsl": "nvfp4_cutedsl",
    "sm100_mxfp8_mxfp8_bf16_cutedsl": "mxfp8_cutedsl",
    "sm90_fp8_fp8_bf16_pull_cutedsl": "sm90_pull_fp8",
    "sm90_fp8_fp8_bf16_push_cuda": "sm90_push_fp8",
}


def kernels_json(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    assert main(["kernels", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert isinstance(data, list)
    return data


def test_kernels_json_lists_canonical_names_only(capsys: pytest.CaptureFixture[str]) -> None:
    data = kernels_json(capsys)
    for row in data:
        assert set(row) >= {"name", "available", "reason", "deprecated_aliases"}
        assert isinstance(row["available"], bool)
        parse_kernel_name(str(row["name"]))  # every listed name is a canonical taxonomy name
        if not row["available"]:
            assert row["reason"], f"{row['name']} is unavailable without a reason"
    names = {str(row["name"]) for row in data}
    aliases = {a for row in data for a in row["deprecated_aliases"]}  # type: ignore[attr-defined]
    assert not names & aliases
    assert names >= PORTABLE
    assert set(GPU) <= names
    for name, alias in GPU.items():
        row = next(r for r in data if r["name"] == name)
        assert alias in row["deprecated_aliases"]  # type: ignore[operator]


def test_portable_kernels_are_available_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    rows = {str(r["name"]): r for r in kernels_json(capsys)}
    for name in PORTABLE:
        assert rows[name]["available"] is True, rows[name]["reason"]


def test_gpu_kernels_say_why_they_cannot_run_here(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present; the no-GPU reasons do not apply")
    rows = {str(r["name"]): r for r in kernels_json(capsys)}
    for name in GPU:
        assert rows[name]["available"] is False
        assert str(rows[name]["reason"]).strip()


def test_kernels_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["kernels"]) == 0
    out = capsys.readouterr().out
    assert "any_bf16_bf16_bf16_torch" in out


def test_info_reports_torch_and_device(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    assert "gloo" in out
    assert "resolved device" in out
    assert "fused CPU epilogues" in out


def test_info_says_what_cpu_prepacked_weights_does_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert GEMM's bodies (from the library's bits) and, per prepacking layout, what
    `cpu_prepacked_weights=True` keeps, or why it is refused."""
    from moe_ep.backends.portable import cpu_fused, experts
    from moe_ep.cli.report import environment_report

    if cpu_fused.library() is None:
        assert environment_report()["CPU expert GEMM"].startswith("not available")
        return
    monkeypatch.setattr(cpu_fused, "vector_bodies", lambda: 1 | 4)
    monkeypatch.setattr(experts, "prepack_layout", lambda device: "k16")
    row = environment_report()["CPU expert GEMM"]
    assert row.startswith(
        "avx2, avx512, avx2kseq; cpu_prepacked_weights=True packs the expert weights for the "
        "expert GEMM's k order"
    )
    assert "fp8's as their e4m3 codes and scales" in row
    monkeypatch.setattr(experts, "prepack_layout", lambda device: "onednn")
    assert "in oneDNN's blocked layout" in environment_report()["CPU expert GEMM"]
    monkeypatch.setattr(experts, "prepack_layout", lambda device: None)
    monkeypatch.setattr(experts, "prepack_host_unavailable", lambda device: "no reason given")
    monkeypatch.setattr(cpu_fused, "vector_bodies", lambda: 0)
    row = environment_report()["CPU expert GEMM"]
    assert row == "the scalar twins only; cpu_prepacked_weights=True refused (no reason given)"


def test_unknown_command_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_console_script_is_installed() -> None:
    exe = shutil.which("moe-ep")
    assert exe is not None, "the moe-ep console script is not on PATH"
    proc = subprocess.run(
        [exe, "kernels", "--json"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert {"any_bf16_bf16_bf16_torch"} <= {r["name"] for r in json.loads(proc.stdout)}

"""`moe-ep run` refuses what cannot run before it spawns any rank."""

from __future__ import annotations

import pytest
import torch

from moe_ep.cli import EXIT_UNAVAILABLE, EXIT_USAGE, main


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_gpu_kernel_on_cpu_is_unavailable_with_its_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["run", "--kernel", "sm90_pull_fp8"]) == EXIT_UNAVAILABLE
    err = capsys.readouterr().err
    assert "'sm90_pull_fp8' is deprecated; use 'sm90_fp8_fp8_bf16_pull_cutedsl'" in err
    # every reason is named (a drop not materialized, where offline, comes first)
    assert "cannot run here: " in err and "no CUDA device visible" in err
    assert "Traceback" not in err


def test_unknown_kernel_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--kernel", "any_bf16_bf16_bf16_nope"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown kernel 'any_bf16_bf16_bf16_nope'" in err
    assert "any_bf16_bf16_bf16_torch" in err


def _fake_gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_more_ranks_than_gpus_is_refused_before_spawning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import moe_ep.spawn

    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("spawned ranks")

    monkeypatch.setattr(moe_ep.spawn, "launch_local", no_spawn)
    monkeypatch.delenv("MEGA_SINGLE_GPU_GLOO", raising=False)
    _fake_gpus(monkeypatch, 1)
    assert main(["run", "--world-size", "2"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "world size 2 spawns one rank per CUDA device, but 1 are visible" in err
    assert "MEGA_SINGLE_GPU_GLOO=1" in err


@pytest.mark.parametrize(
    ("gpus", "share", "expected"), [(0, "0", 2), (1, "0", 1), (1, "1", 2), (2, "0", 2), (8, "0", 2)]
)
def test_demo_runs_one_rank_on_a_single_gpu(
    monkeypatch: pytest.MonkeyPatch, gpus: int, share: str, expected: int
) -> None:
    from moe_ep.cli import jobs

    _fake_gpus(monkeypatch, gpus)
    monkeypatch.setenv("MEGA_SINGLE_GPU_GLOO", share)
    assert jobs._demo_world_size() == expected

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
    assert "cannot run here: no CUDA device" in err
    assert "Traceback" not in err


def test_unknown_kernel_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--kernel", "any_bf16_bf16_bf16_nope"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown kernel 'any_bf16_bf16_bf16_nope'" in err
    assert "any_bf16_bf16_bf16_torch" in err


@pytest.mark.parametrize(
    ("rank_errors", "expected"),
    [({1: "MoeEpUsageError"}, EXIT_USAGE), ({1: "RuntimeError"}, None)],
)
def test_a_rank_side_usage_error_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    rank_errors: dict[int, str],
    expected: int | None,
) -> None:
    import moe_ep.launch
    from moe_ep.errors import MoeEpPeerError

    def failing_spawn(*args: object, **kwargs: object) -> list[object]:
        raise MoeEpPeerError("rank 1 failed", rank_errors=rank_errors)

    monkeypatch.setattr(moe_ep.launch, "spawn_local", failing_spawn)
    argv = ["run", "--kernel", "any_bf16_bf16_bf16_torch", "--world-size", "2"]
    if expected is None:  # any other rank failure stays a peer error
        with pytest.raises(MoeEpPeerError, match="rank 1 failed"):
            main(argv)
    else:
        assert main(argv) == expected
        assert "rank 1 failed" in capsys.readouterr().err

"""`moe-ep run` / `moe-ep demo` exit codes and messages (tiny shapes)."""

from __future__ import annotations

import pytest

from moe_ep import oracle
from moe_ep.cli import main
from moe_ep.spawn import free_port

TINY = ["--tokens", "16", "--hidden", "128", "--intermediate", "128", "--experts", "4"]
TINY += ["--topk", "2", "--iters", "1"]


@pytest.mark.multirank
def test_run_spawns_ranks_and_checks(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["run", "--world-size", "2", "--kernel", "any_mxfp8_mxfp8_bf16_torch", "--check", *TINY]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "any_mxfp8_mxfp8_bf16_torch" in out and "ok" in out and "EP2" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "3"], "--experts must be divisible by --world-size"),
        (["--kernel", "nope"], "unknown kernel 'nope'"),
        (["--topk", "9"], "--topk (9) must be <= --experts (4)"),
        (["--kernel", "any_fp8_fp8_bf16_torch", "--intermediate", "64"], "multiples of 128"),
        (["--tokens", "-1"], "--tokens must be >= 0"),
    ],
)
def test_run_bad_arguments_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", *TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_run_unparsable_argument_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["run", "--tokens", "many"])
    assert exc.value.code == 2
    assert "invalid int value: 'many'" in capsys.readouterr().err


def _torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)


def test_run_under_torchrun_env_runs_in_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _torchrun_env(monkeypatch)
    assert main(["run", "--check", "--routing", "skewed", *TINY]) == 0
    assert "EP1" in capsys.readouterr().out


def test_run_exits_1_when_the_check_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _torchrun_env(monkeypatch)  # in-process, so the patched oracle is the one used

    real = oracle.compare_to_oracle

    def off_by_one(output, reference, **kw):  # type: ignore[no-untyped-def]
        return real(output + 1, reference, **kw)

    monkeypatch.setattr(oracle, "compare_to_oracle", off_by_one)
    assert main(["run", "--check", *TINY]) == 1
    captured = capsys.readouterr().out
    assert "FAIL" in captured and "check failed" in captured


@pytest.mark.multirank
def test_demo_checks_every_portable_format(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert "moe-ep environment" in out and "EP2" in out
    for kernel in (
        "any_bf16_bf16_bf16_torch",
        "any_fp8_fp8_bf16_torch",
        "any_mxfp8_mxfp8_bf16_torch",
        "any_nvfp4_nvfp4_bf16_torch",
        "any_fp8_fp4_bf16_torch",
        "any_fp8_mxfp4_bf16_torch",
        "any_fp8_nvfp4_bf16_torch",
        "any_mxfp8_mxfp4_bf16_torch",
    ):
        line = next(row for row in out.splitlines() if kernel in row)
        assert " ok " in line, line

"""Every failure of `moe-ep` prints one `moe-ep: error:` line (no traceback unless asked for)
and exits with its kind's documented code; ranks are real processes where a rank fails."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from moe_ep.cli import EXIT_INTERNAL, EXIT_PEER, EXIT_UNAVAILABLE, EXIT_USAGE, jobs, main
from moe_ep.env import all_env_vars
from moe_ep.errors import MoeEpTimeoutError, MoeEpUsageError

TINY = ["--tokens", "8", "--hidden", "64", "--intermediate", "32", "--experts", "4"]
TINY += ["--topk", "2", "--iters", "1"]
RUN2 = ["run", "--world-size", "2", *TINY]


def error_lines(err: str) -> list[str]:
    """The `moe-ep: error:` lines of `err`, after checking there is no traceback."""
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("moe-ep: error:")]


def one_error(err: str) -> str:
    lines = error_lines(err)
    assert len(lines) == 1, err
    return lines[0]


# Ranks of `moe-ep run` (patched over `jobs.run_job`; spawned, so top level).


def _usage_error_on_rank_one(rank: int, world_size: int, spec: Any, gather: bool = False) -> Any:
    if rank == 1:
        raise MoeEpUsageError("topk_ids has values outside [-1, 4): max=9 at row 3")
    return []


def _killed_on_rank_one(rank: int, world_size: int, spec: Any, gather: bool = False) -> Any:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # as a collective would notice the dead peer
    raise MoeEpTimeoutError("moe-ep barrier: rank(s) [1] did not arrive (1/2 did)")


def _runtime_error_on_rank_zero(rank: int, world_size: int, spec: Any, gather: bool = False) -> Any:
    if rank == 0:
        raise RuntimeError("gloo all_to_all: connection reset")
    return []


def test_a_usage_error_raised_on_a_rank_is_one_line_exit_2(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(jobs, "run_job", _usage_error_on_rank_one)
    assert main(RUN2) == EXIT_USAGE
    assert one_error(capfd.readouterr().err) == (
        "moe-ep: error: rank 1: topk_ids has values outside [-1, 4): max=9 at row 3"
    )


def test_a_rank_killed_by_sigkill_names_the_signal_and_its_usual_cause(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(jobs, "run_job", _killed_on_rank_one)
    assert main(RUN2) == EXIT_PEER
    line = one_error(capfd.readouterr().err)
    assert line.startswith(
        "moe-ep: error: rank 1 was killed by SIGKILL (exit code -9), usually the out-of-memory "
        "killer; then rank(s) [0] failed waiting for their peers; use fewer ranks"
    ), line
    assert "--debug" in line


def test_a_rank_raising_another_error_is_exit_4_and_debug_shows_its_traceback(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(jobs, "run_job", _runtime_error_on_rank_zero)
    assert main(RUN2) == EXIT_PEER
    line = one_error(capfd.readouterr().err)
    assert "rank 0 raised RuntimeError: gloo all_to_all: connection reset" in line
    assert main(["--debug", *RUN2]) == EXIT_PEER
    err = capfd.readouterr().err
    assert "Traceback" in err and "_runtime_error_on_rank_zero" in err  # the rank's own
    assert err.rstrip().splitlines()[-1].startswith("moe-ep: error: rank 0 raised RuntimeError")


def test_fused_epilogues_required_without_a_c_compiler_is_unavailable_exit_3(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # cpu_fused takes CC when set, else cc / gcc / clang from PATH: hide all of them
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("MOE_EP_CPU_FUSED", "1")
    assert main(RUN2) == EXIT_UNAVAILABLE
    line = one_error(capfd.readouterr().err)
    assert line.startswith("moe-ep: error: ranks [0, 1]: MOE_EP_CPU_FUSED=1 but the fused CPU")
    assert "no C compiler found: CC is unset and none of cc, gcc, clang is on PATH" in line
    monkeypatch.setenv("CC", "no-such-cc")
    assert main(RUN2) == EXIT_UNAVAILABLE
    assert "CC='no-such-cc' is not an executable command" in one_error(capfd.readouterr().err)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer in 0..2147483647, got 'x'"),
        ({"RANK": "0"}, "RANK and WORLD_SIZE must be set together; WORLD_SIZE is unset"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK must be < WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "1"}, "MASTER_ADDR and MASTER_PORT are not"),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "h", "MASTER_PORT": "0"},
            "MASTER_PORT must be an integer in 1..65535, got '0'",
        ),
    ],
)
def test_malformed_torchrun_variables_are_usage_errors(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    values: dict[str, str],
    message: str,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    assert main(["run", *TINY]) == EXIT_USAGE
    assert message in one_error(capsys.readouterr().err)


@pytest.mark.parametrize("debug", [["--debug"], []])
def test_an_internal_error_is_exit_5_with_a_traceback_only_when_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], debug: list[str]
) -> None:
    def broken(spec: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(jobs, "preflight", broken)
    if not debug:
        monkeypatch.delenv("MOE_EP_DEBUG", raising=False)
        assert main(["run", *TINY]) == EXIT_INTERNAL
        line = one_error(capsys.readouterr().err)
        assert line.startswith("moe-ep: error: internal error: RuntimeError: boom (a bug")
        assert "--debug" in line
        monkeypatch.setenv("MOE_EP_DEBUG", "1")
    assert main([*debug, "run", *TINY]) == EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "in broken" in err
    assert (
        err.rstrip().splitlines()[-1]
        == "moe-ep: error: internal error: RuntimeError: boom (a bug: please report it)"
    )


def test_a_malformed_moe_ep_debug_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("MOE_EP_DEBUG", "yes")
    assert main(["kernels", "--json"]) == EXIT_USAGE
    assert "MOE_EP_DEBUG must be 0 or 1, got 'yes'" in one_error(capsys.readouterr().err)


def test_sigterm_is_exit_143_and_the_previous_handler_is_restored(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))

    def terminated_while_running(spec: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises in here
        raise AssertionError("SIGTERM did not stop moe-ep run")

    monkeypatch.setattr(jobs, "execute", terminated_while_running)
    try:
        assert main(["run", *TINY]) == 128 + signal.SIGTERM
        assert one_error(capsys.readouterr().err) == "moe-ep: error: terminated by SIGTERM"
        assert seen == []  # moe-ep's handler took it ...
        os.kill(os.getpid(), signal.SIGTERM)  # ... and gave the old one back
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_is_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(spec: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(jobs, "execute", interrupted)
    try:
        code = main(["run", *TINY])
    except KeyboardInterrupt:  # (it would end the whole test session)
        pytest.fail("KeyboardInterrupt escaped main()")
    assert code == 130
    assert one_error(capsys.readouterr().err) == "moe-ep: error: interrupted (SIGINT)"


MALFORMED = {"MOE_EP_TIMEOUT_S": "abc", "LOCAL_RANK": "-1", "MOE_EP_CPU_FUSED": "on"}


@pytest.mark.parametrize(("name", "value"), sorted(MALFORMED.items()))
def test_info_exits_2_naming_a_malformed_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, value: str
) -> None:
    assert name in {n.strip() for v in all_env_vars() for n in v.name.split(",")}
    monkeypatch.setenv(name, value)
    assert main(["info"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert f"environment variable {name} " in one_error(captured.err)
    assert repr(value) in captured.err
    assert captured.out == ""  # no report built on a broken environment


def test_info_names_every_malformed_variable_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in MALFORMED.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MOE_EP_TIMEOUT_S", "1e15")  # in float range, not in the allowed one
    assert main(["info"]) == EXIT_USAGE
    line = one_error(capsys.readouterr().err)
    assert all(f"environment variable {name} " in line for name in MALFORMED)
    assert "<= 604800" in line


def test_run_checks_the_environment_before_spawning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import moe_ep.spawn

    def no_spawn(*args: object, **kwargs: object) -> None:
        raise AssertionError("spawned ranks")

    for name in ("launch_local", "spawn_local"):
        monkeypatch.setattr(moe_ep.spawn, name, no_spawn, raising=False)
    monkeypatch.setenv("MOE_EP_TIMEOUT_S", "1e15")
    assert main(RUN2) == EXIT_USAGE
    assert "MOE_EP_TIMEOUT_S" in one_error(capsys.readouterr().err)


def test_python_m_moe_ep_cli_runs_the_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "moe_ep.cli", "run", "--kernel", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert one_error(proc.stderr).startswith("moe-ep: error: unknown kernel 'nope'")

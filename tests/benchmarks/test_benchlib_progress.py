"""`moe_ep.bench.progress`: off a terminal, progress is plain numbered lines as each step
starts."""

from __future__ import annotations

import io

import pytest

from moe_ep.bench.progress import Steps


def test_plain_numbered_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    with Steps(3, stream=out) as steps:  # StringIO is not a tty: plain lines
        steps.step("prefill T=4096 ...")
        assert out.getvalue() == "[1/3] prefill T=4096 ...\n"  # printed as the step starts
        steps.step("decode T=64 ...")
        steps.step("memory")
    assert out.getvalue().splitlines() == [
        "[1/3] prefill T=4096 ...",
        "[2/3] decode T=64 ...",
        "[3/3] memory",
    ]


def test_numbering_continues_after_steps_told_elsewhere() -> None:
    out = io.StringIO()
    steps = Steps(5, stream=out, live=False, done=1)  # e.g. a rank after its parent's step
    steps.step("rendezvous")
    assert out.getvalue() == "[2/5] rendezvous\n"


def test_one_step_too_many_and_bad_counts_are_refused() -> None:
    steps = Steps(1, stream=io.StringIO())
    steps.step("only")
    with pytest.raises(ValueError, match="step 2 of 1"):
        steps.step("extra")
    for total, done in ((0, 0), (2, 3), (2, -1)):
        with pytest.raises(ValueError, match="total >= 1"):
            Steps(total, done=done)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_not_lines() -> None:
    out = _Tty()
    with Steps(2, stream=out) as steps:
        steps.step("a")
        steps.step("b")
    assert "[1/2] a\n" not in out.getvalue()  # no plain line: rich drew (and cleared) a bar

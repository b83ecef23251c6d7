"""`benchlib.options`: bad values are refused with the option, the value and the rule."""

from __future__ import annotations

import argparse

import pytest
from benchlib.options import benchmark_parser, moe_shape, positive_int, positive_multiple_of


def _parser() -> argparse.ArgumentParser:
    p = benchmark_parser("Measures X. Target: <= 2x.")
    p.add_argument("--reps", type=positive_int, default=5, help="timed runs")
    p.add_argument("--cols", type=positive_multiple_of(128), default=256, help="columns")
    p.add_argument("--shape", type=moe_shape, default="8,16,32,4,2", help="the shape")
    p.add_argument("--flag", action="store_true", help="a switch")
    return p


def test_values_parse() -> None:
    args = _parser().parse_args(["--reps", "3", "--cols", "384", "--shape", "64, 2048,1024,64,8"])
    assert (args.reps, args.cols) == (3, 384)
    assert args.shape == {"T": 64, "H": 2048, "I": 1024, "E": 64, "k": 8}
    assert _parser().parse_args([]).shape == {"T": 8, "H": 16, "I": 32, "E": 4, "k": 2}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reps", "0"], "argument --reps: must be an integer >= 1, got 0"),
        (["--reps", "x"], "argument --reps: must be an integer >= 1, got 'x'"),
        (["--cols", "200"], "argument --cols: must be a multiple of 128, got 200"),
        (["--shape", "1,2,3"], "argument --shape: must be T,H,I,E,k"),
        (["--shape", "8,16,32,4,9"], "top-k must be <= the experts E, got k=9 > E=4"),
        (["--shape", "8,16,0,4,2"], "argument --shape: must be an integer >= 1, got 0"),
    ],
)
def test_bad_values_exit_2_naming_option_value_and_rule(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_help_keeps_the_description_and_shows_defaults_of_valued_options() -> None:
    text = " ".join(_parser().format_help().split())
    assert "Measures X. Target: <= 2x." in text
    assert "timed runs (default: 5)" in text
    assert "the shape (default: 8,16,32,4,2)" in text
    assert "a switch (default" not in text  # a flag's "False" says nothing

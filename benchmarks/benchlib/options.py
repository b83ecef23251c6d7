"""argparse value types whose errors name the rule (argparse adds the option and value)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

SHAPE_KEYS = ("T", "H", "I", "E", "k")


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def positive_multiple_of(step: int) -> Callable[[str], int]:
    """A type for an integer >= 1 that is a multiple of `step`."""

    def parse(text: str) -> int:
        value = positive_int(text)
        if value % step:
            raise argparse.ArgumentTypeError(f"must be a multiple of {step}, got {value}")
        return value

    parse.__name__ = f"multiple of {step}"  # argparse names the type in some messages
    return parse


def moe_shape(text: str) -> dict[str, int]:
    """ "T,H,I,E,k" (tokens, hidden, intermediate, experts, top-k): five integers >= 1 with
    k <= E, e.g. "4096,2048,1024,16,4"."""
    parts = text.split(",")
    if len(parts) != len(SHAPE_KEYS):
        raise argparse.ArgumentTypeError(
            f"must be T,H,I,E,k (five integers, e.g. 4096,2048,1024,16,4), got {text!r}"
        )
    shape = {key: positive_int(part.strip()) for key, part in zip(SHAPE_KEYS, parts, strict=True)}
    if shape["k"] > shape["E"]:
        raise argparse.ArgumentTypeError(
            f"top-k must be <= the experts E, got k={shape['k']} > E={shape['E']}"
        )
    return shape


def shape_text(shape: dict[str, int]) -> str:
    """ "T=4096 H=2048 I=1024 E=16 k=4"."""
    return " ".join(f"{key}={shape[key]}" for key in SHAPE_KEYS)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each valued option's default after its help
    (flags, whose default is off, show none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
            return text
        default = action.default
        if isinstance(default, list):
            default = " ".join(str(v) for v in default)
        return f"{text} (default: {default})"


def benchmark_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the script's docstring (what it measures, the
    targets)."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


def add_plot_options(parser: argparse.ArgumentParser, default: Path) -> None:
    """`--out PATH` (where the PNG goes) and `--no-plot`."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--out", type=Path, default=default, help="where to write the PNG plot")
    group.add_argument("--no-plot", action="store_true", help="print the table only, no PNG")

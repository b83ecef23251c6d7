"""The benchmark tables: a console that does not wrap them in logs, titled like the plots."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

LOG_WIDTH = 1000
"""Columns when stdout is not a terminal: wider than any table here, so that a log keeps
every cell whole (rich would wrap at 80, and at 180 it cut the peers table's numbers); a
table still prints at its own width, its caption wrapped to it."""


def console(log_width: int = LOG_WIDTH) -> Console:
    """A console on stdout: the terminal's width there, `log_width` columns in a log."""
    return Console(width=None if sys.stdout.isatty() else log_width)


def titled_table(
    what: str, shape: str, machine: str, columns: Sequence[str], caption: str | None = None
) -> Table:
    """A table titled with what is measured, the shape and the machine (and `caption` below,
    e.g. the targets); the first column left-aligned (names), the others right-aligned
    (numbers, targets, status)."""
    table = Table(title=f"{what}\n{shape}\n{machine}", caption=caption)
    for j, col in enumerate(columns):
        table.add_column(
            col, justify="left" if j == 0 else "right", no_wrap=col in ("status", "kernel")
        )
    return table

"""Progress reporting for long fetches and extractions (rich, on stderr; silent when quiet)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

__all__ = ["Progress", "make_progress"]


class Progress(Protocol):
    """What sources call while they work."""

    def task(
        self, description: str, total: int | None
    ) -> AbstractContextManager[Callable[[int], None]]: ...


class _Quiet:
    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
        yield lambda amount: None


class _Rich:
    @contextmanager
    def task(self, description: str, total: int | None) -> Iterator[Callable[[int], None]]:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
        from rich.progress import Progress as RichProgress

        is_bytes = description.startswith("fetch")
        columns = (
            [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn()]
            if is_bytes
            else [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
        )
        with RichProgress(
            *columns, TimeRemainingColumn(), console=Console(stderr=True), transient=False
        ) as bar:
            tid = bar.add_task(description, total=total)
            yield lambda amount: bar.advance(tid, amount)


def make_progress(quiet: bool) -> Progress:
    """A rich progress reporter on stderr, or a silent one."""
    return _Quiet() if quiet else _Rich()

"""Numbered progress for benchmarks: a rich bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TextIO

from rich.console import Console
from rich.progress import Progress, TaskID


class Steps:
    """Announce the steps of a run as they start: "[3/12] prefill T=4096 ...".

    On a terminal (`stream.isatty()`, or `live=True`) a transient rich bar shows them; else
    each is one plain line on `stream` (default stderr), flushed, so logs and pipes see
    progress as it happens. `done` counts steps already announced elsewhere (e.g. by the
    parent of a spawned rank), so numbering continues.
    """

    def __init__(
        self, total: int, *, stream: TextIO | None = None, live: bool | None = None, done: int = 0
    ) -> None:
        if total < 1 or not 0 <= done <= total:
            raise ValueError(f"Steps needs total >= 1 and 0 <= done <= total, got {total}, {done}")
        self.total = total
        self.count = done
        self._stream = stream if stream is not None else sys.stderr
        self._live = self._stream.isatty() if live is None else live
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Steps:
        if self._live:
            self._progress = Progress(console=Console(file=self._stream), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("", total=self.total, completed=self.count)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def step(self, what: str) -> None:
        """Start the next step, described by `what`."""
        if self.count >= self.total:
            raise ValueError(f"step {self.count + 1} of {self.total} announced: {what!r}")
        self.count += 1
        line = f"[{self.count}/{self.total}] {what}"
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, description=line, completed=self.count - 1)
        else:
            print(line, file=self._stream, flush=True)

"""Staging directories inside a drop, and the all-or-nothing swap of staged paths into place.

A command that changes a drop writes the new state (a whole `src/`, the lock, VENDOR.md, a
patch) into `<drop>/.vendor-tmp-<pid>-<hex>/` first; `Staging.commit` then swaps each staged
path with its target. On Linux a swap is one atomic `renameat2(RENAME_EXCHANGE)`, so no
reader ever sees a missing or half-written `src/`; where that call is unavailable it falls
back to three renames (a short window without the target). If a swap fails, the ones done
are swapped back, so the drop is as it was. The staging directory, which then holds the old
versions, is removed on success and on failure; one left by a killed process is removed by
the next command that works on that drop (`sweep_stale`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import uuid
from functools import lru_cache
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["STAGING_PREFIX", "Staging", "exchange", "sweep_stale"]

STAGING_PREFIX = ".vendor-tmp-"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@lru_cache(maxsize=1)
def _renameat2() -> Any:
    if sys.platform != "linux":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # no libc symbol (glibc < 2.28, musl): fall back
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _atomic_exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step; False when the system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # kernel or file system lacks it
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def exchange(a: Path, b: Path) -> None:
    """Swap `a` and `b`; when only one exists, rename it to the other. Its own inverse."""
    if not os.path.lexists(b):
        os.rename(a, b)
    elif not os.path.lexists(a):
        os.rename(b, a)
    elif not _atomic_exchange(a, b):
        aside = a.with_name(a.name + ".swap")
        os.rename(b, aside)
        try:
            os.rename(a, b)
        except OSError:
            os.rename(aside, b)
            raise
        os.rename(aside, a)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def sweep_stale(drop_dir: Path) -> list[str]:
    """Remove staging directories of processes that are gone; returns their names."""
    removed: list[str] = []
    if not drop_dir.is_dir():
        return removed
    for entry in sorted(drop_dir.glob(STAGING_PREFIX + "*")):
        pid_text, sep, _ = entry.name[len(STAGING_PREFIX) :].partition("-")
        pid = int(pid_text) if sep and pid_text.isdigit() else 0  # 0: no owner recorded
        if pid and pid != os.getpid() and _alive(pid):
            continue  # another sync of this drop is running
        _remove(entry)
        removed.append(entry.name)
    return removed


class Staging:
    """A staging directory inside `parent`, removed when the `with` block ends."""

    def __init__(self, parent: Path) -> None:
        self.dir = parent / f"{STAGING_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"

    def __enter__(self) -> Staging:
        sweep_stale(self.dir.parent)
        self.dir.mkdir()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            _remove(self.dir)
        except OSError as cleanup:
            if exc is None:
                raise
            exc.add_note(f"and the staging directory {self.dir} could not be removed: {cleanup}")

    def path(self, name: str) -> Path:
        """A path inside the staging directory."""
        return self.dir / name

    def commit(self, moves: list[tuple[Path, Path]]) -> None:
        """Swap each `(staged, target)` pair, in order; all or nothing.

        A staged path that does not exist moves the target into staging (a deletion that
        is undone on failure). After success the staged paths hold the old versions.
        """
        done: list[tuple[Path, Path]] = []
        try:
            for staged, target in moves:
                exchange(staged, target)
                done.append((staged, target))
        except BaseException:
            for staged, target in reversed(done):
                exchange(staged, target)
            raise

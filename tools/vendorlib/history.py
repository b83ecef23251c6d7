"""Is a drop's `src/` an unmodified earlier materialization? Asked of the checkout's git history.

A `git pull` or merge that re-pins a drop replaces its lock but leaves the old `src/` behind.
Those bytes are not local edits when they equal, file for file, a lock this drop had in an
earlier commit: `sync` may then replace them without `--force`. Offline (local git only);
without git, or outside a repository, nothing matches and `sync` refuses as before.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from vendorlib.drops import Drop
from vendorlib.errors import UsageError
from vendorlib.lockfile import diff_entries, parse_lock, scan_dir

__all__ = ["HISTORY_DEPTH", "earlier_lock_matching"]

HISTORY_DEPTH = 50
"""How many of the lock's past revisions are compared (newest first)."""


def _git(root: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def earlier_lock_matching(root: Path, drop: Drop) -> str | None:
    """The commit of the newest past version of `drop`'s lock that `src/` matches exactly
    (every file's sha256 and mode, nothing missing or extra, no symlink), or None."""
    rel = drop.lock_path.relative_to(root).as_posix()
    revs = _git(root, "log", f"-{HISTORY_DEPTH}", "--format=%H", "--", rel)
    if not revs:
        return None
    actual, odd = scan_dir(drop.src)
    if odd:
        return None
    for rev in revs.split():
        text = _git(root, "show", f"{rev}:{rel}")
        if text is None:
            continue  # the commit that deleted the lock
        try:
            lock = parse_lock(text, f"{rev}:{rel}")
        except UsageError:
            continue
        if not any(diff_entries(lock.files, actual).values()):
            return rev
    return None

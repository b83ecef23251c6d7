"""Path globs for include/exclude: `*` and `?` stay inside one path part, `**` spans parts."""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import lru_cache

__all__ = ["glob_to_regex", "matches_any", "select"]


@lru_cache(maxsize=256)
def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a POSIX-path glob (`**/x.py`, `src/*.cu`, `**`) to an anchored regex."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def matches_any(path: str, patterns: Iterable[str]) -> bool:
    """True when `path` (POSIX, relative) matches one of `patterns`."""
    return any(glob_to_regex(p).match(path) for p in patterns)


def select(path: str, include: Iterable[str], exclude: Iterable[str]) -> bool:
    """True when `path` is included and not excluded."""
    return matches_any(path, include) and not matches_any(path, exclude)

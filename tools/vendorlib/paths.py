"""Paths taken from a source, a VENDOR.md or a lock: checked before the tool reads,
writes or deletes anything through them.

`relative_path` is the lexical rule (relative, POSIX, no `..`, no empty part); `inside`
adds the file-system rule (after resolving symlinks the path stays under its base).
"""

from __future__ import annotations

from pathlib import Path

from vendorlib.errors import UsageError

__all__ = ["inside", "relative_path", "unsafe_reason"]


def unsafe_reason(path: str) -> str:
    """Why `path` is not a safe relative POSIX path, or "" when it is."""
    parts = path.split("/")
    if not path:
        return "it is empty"
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        return "it is absolute"
    if "\\" in path:
        return "it holds a backslash"
    if ".." in parts:
        return "it holds a `..` part"
    if "" in parts or "." in parts:
        return "it holds an empty or `.` part"
    return ""


def relative_path(path: str, where: str, example: str) -> str:
    """`path` unchanged when it is a safe relative path; else `UsageError` naming `where`
    (e.g. "VENDOR.md [[pending]] #1 patch"), the value, the rule and `example`."""
    why = unsafe_reason(path)
    if why:
        raise UsageError(
            f"{where} {path!r} is refused: {why}; it must be a relative POSIX path that stays "
            f"inside its directory, e.g. {example!r}"
        )
    return path


def inside(base: Path, path: str, where: str, example: str) -> Path:
    """`base / path`, refused (`UsageError`) when it is not a safe relative path or when
    symlinks take it outside `base`."""
    full = base / relative_path(path, where, example)
    real, real_base = full.resolve(), base.resolve()
    if real != real_base and real_base not in real.parents:
        raise UsageError(
            f"{where} {path!r} resolves to {real}, outside {real_base}: a symlink on the way "
            "leads out, and the path must stay inside; refusing to use it"
        )
    return full

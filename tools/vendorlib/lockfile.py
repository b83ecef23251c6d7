"""`vendor.lock.json`: per file path, mode, size, sha256 and git blob id, plus a tree digest.

A `Tree` is the in-memory form of a drop's bytes: `{relative POSIX path: (mode, bytes)}` with
mode `0o644` or `0o755` (only the executable bit is kept, as git does).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vendorlib.errors import UsageError
from vendorlib.paths import unsafe_reason

__all__ = [
    "LOCK_NAME",
    "LOCK_SCHEMA",
    "FileEntry",
    "Lock",
    "Tree",
    "diff_entries",
    "entries_of",
    "entry_of",
    "git_blob_id",
    "load_lock",
    "mode_str",
    "parse_lock",
    "scan_dir",
    "tree_digest",
    "write_lock",
]

LOCK_NAME = "vendor.lock.json"
LOCK_SCHEMA = 1

Tree = dict[str, tuple[int, bytes]]


@dataclass(frozen=True)
class FileEntry:
    """One locked file: git-style mode string (`100644`/`100755`), size, sha256, git blob id."""

    path: str
    mode: str
    size: int
    sha256: str
    git_blob: str


@dataclass(frozen=True)
class Lock:
    """A parsed lock: the pin it was generated from, pending paths, and the file entries."""

    drop: str
    pin: dict[str, str]
    pending: dict[str, str]
    files: dict[str, FileEntry]
    tree_sha256: str


def mode_str(mode: int) -> str:
    """`0o755` -> `100755`; anything without an executable bit -> `100644`."""
    return "100755" if mode & 0o111 else "100644"


def git_blob_id(data: bytes) -> str:
    """The id git gives `data` as a blob (sha1 of `blob <len>\\0` + data)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def entry_of(path: str, mode: int, data: bytes) -> FileEntry:
    """The lock entry of one file."""
    return FileEntry(
        path=path,
        mode=mode_str(mode),
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        git_blob=git_blob_id(data),
    )


def entries_of(tree: Tree) -> dict[str, FileEntry]:
    """Lock entries of a whole tree, sorted by path."""
    return {p: entry_of(p, tree[p][0], tree[p][1]) for p in sorted(tree)}


def tree_digest(entries: dict[str, FileEntry]) -> str:
    """sha256 over `<mode> <sha256> <path>\\n` for every file in path order."""
    h = hashlib.sha256()
    for path in sorted(entries):
        e = entries[path]
        h.update(f"{e.mode} {e.sha256} {path}\n".encode())
    return h.hexdigest()


def _is_bytecode(rel: str) -> bool:
    # Importing a CuTe DSL drop writes __pycache__/*.pyc into src/; those are not drop bytes.
    parts = rel.split("/")
    return "__pycache__" in parts[:-1] and rel.endswith(".pyc")


def scan_dir(root: Path) -> tuple[dict[str, FileEntry], list[str]]:
    """Entries of every regular file under `root` (bytecode caches skipped).

    Returns `(entries, not_regular)` where `not_regular` lists symlinks and other
    non-regular paths found (a drop holds regular files only).
    """
    entries: dict[str, FileEntry] = {}
    odd: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for name in list(dirnames):
            if os.path.islink(os.path.join(dirpath, name)):
                odd.append(Path(dirpath, name).relative_to(root).as_posix())
                dirnames.remove(name)
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            rel = Path(full).relative_to(root).as_posix()
            st = os.lstat(full)
            if not stat.S_ISREG(st.st_mode):
                odd.append(rel)
                continue
            if _is_bytecode(rel):
                continue
            with open(full, "rb") as fh:
                data = fh.read()
            entries[rel] = entry_of(rel, st.st_mode, data)
    return dict(sorted(entries.items())), sorted(odd)


def diff_entries(
    expected: dict[str, FileEntry], actual: dict[str, FileEntry]
) -> dict[str, list[str]]:
    """Compare two entry maps: `missing`, `extra`, `modified` (content), `mode` (mode only)."""
    missing = sorted(set(expected) - set(actual))
    extra = sorted(set(actual) - set(expected))
    modified: list[str] = []
    mode: list[str] = []
    for path in sorted(set(expected) & set(actual)):
        if expected[path].sha256 != actual[path].sha256:
            modified.append(path)
        elif expected[path].mode != actual[path].mode:
            mode.append(path)
    return {"missing": missing, "extra": extra, "modified": modified, "mode": mode}


def write_lock(
    path: Path,
    drop: str,
    pin: dict[str, str],
    pending: dict[str, str],
    entries: dict[str, FileEntry],
) -> None:
    """Write the lock deterministically (sorted keys, LF, trailing newline)."""
    doc: dict[str, Any] = {
        "schema": LOCK_SCHEMA,
        "drop": drop,
        "generated_by": "uv run tools/vendor.py sync",
        "pin": dict(sorted(pin.items())),
        "pending": dict(sorted(pending.items())),
        "file_count": len(entries),
        "total_bytes": sum(e.size for e in entries.values()),
        "tree_sha256": tree_digest(entries),
        "files": [
            {
                "path": e.path,
                "mode": e.mode,
                "size": e.size,
                "sha256": e.sha256,
                "git_blob": e.git_blob,
            }
            for e in (entries[p] for p in sorted(entries))
        ],
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def load_lock(path: Path) -> Lock:
    """Parse a lock; a malformed one raises `UsageError` naming the file and the problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(
            f"{path}: missing; run `uv run tools/vendor.py sync` to create it"
        ) from None
    return parse_lock(text, str(path))


def parse_lock(text: str, path: str) -> Lock:
    """Parse the lock text read from `path` (a file, or `REV:file` of git's history)."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc})") from None
    try:
        if doc["schema"] != LOCK_SCHEMA:
            raise UsageError(
                f"{path}: schema {doc['schema']!r} unsupported (expected {LOCK_SCHEMA})"
            )
        files = {
            f["path"]: FileEntry(f["path"], f["mode"], int(f["size"]), f["sha256"], f["git_blob"])
            for f in doc["files"]
        }
        for rel in [*files, *doc.get("pending", {})]:
            if unsafe_reason(str(rel)):
                raise UsageError(
                    f"{path}: file path {rel!r} is refused ({unsafe_reason(str(rel))}); a lock "
                    "lists paths relative to src/ only"
                )
        return Lock(
            drop=str(doc["drop"]),
            pin={str(k): str(v) for k, v in doc["pin"].items()},
            pending={str(k): str(v) for k, v in doc.get("pending", {}).items()},
            files=files,
            tree_sha256=str(doc["tree_sha256"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(f"{path}: malformed lock ({type(exc).__name__}: {exc})") from None

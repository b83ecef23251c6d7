"""Private, verified build caches: where moe-ep keeps code it compiled and will load.

The fused CPU epilogue library (`cpu_fused`), the sm90 push kernel's modules and compiled
CuTe DSL kernels (`moe_ep.backends.support.cutedsl.kernel_cache`) are built on first use and
cached on disk. A file another user can write there runs inside every moe-ep process that
loads it, so the caches follow the same rules, all of them here:

- Cache directory: the variable's value (absolute: `moe_ep.env` refuses a relative one) or
  `$HOME/.cache/moe-ep/<leaf>` (HOME set, absolute, an existing directory). Missing
  directories are created 0700. The cache directory and every directory created on the way
  must be owned by this user and not writable by group or others; every directory above
  must be owned by this user or root and not writable by group or others unless sticky
  (`/tmp`). Otherwise `MoeEpUnavailableError` names the directory and what is wrong.
- Entry (one build): a directory built privately beside its final name, every file made
  not group/other-writable, with a manifest of each file's sha256, then renamed into place
  in one step. Concurrent builders never see half an entry; one that loses the race uses
  the winner's entry.
- An entry is used only when it and everything in it is owned by this user, not writable by
  group or others, holds only directories and regular files, and its files are exactly the
  manifest's, with the recorded digests. Any other entry is moved aside and rebuilt.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from moe_ep import env
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError

__all__ = [
    "MANIFEST",
    "cache_dir",
    "discard",
    "entry_problem",
    "find_entry",
    "private_dir",
    "publish",
    "stage",
]

MANIFEST = "manifest.json"
"""The file in each entry recording the sha256 of every other file in it."""

_GROUP_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


class _Untrusted(Exception):
    """An entry fails a rule; the message says which file and why."""


def cache_dir(var: str, value: str | None, leaf: str) -> Path:
    """The private cache directory: `value` (the variable `var`, absolute), else
    `$HOME/.cache/moe-ep/<leaf>`; created and checked by `private_dir`.

    Raises:
        MoeEpUnavailableError: HOME unset, empty, relative or not a directory (when `value`
            is None), or the directory is not private (see the module docstring).
    """
    if value is not None:
        return private_dir(Path(value), origin=f"{var}={value!r}")
    home = env.home_dir()
    fix = f"set {var} to an absolute directory only you can write"
    if home is None:
        raise MoeEpUnavailableError(
            f"{var} is unset and HOME is unset or empty, so its default "
            f"$HOME/.cache/moe-ep/{leaf} has no base; {fix} (or set HOME)"
        )
    if not os.path.isabs(home) or not os.path.isdir(home):
        rule = "not an absolute path" if not os.path.isabs(home) else "not an existing directory"
        raise MoeEpUnavailableError(
            f"{var} is unset and HOME={home!r} is {rule}, so its default "
            f"$HOME/.cache/moe-ep/{leaf} cannot be used; {fix} (or fix HOME)"
        )
    path = Path(home) / ".cache" / "moe-ep" / leaf
    return private_dir(path, origin=f"default of {var} under HOME={home!r}; {fix}")


def private_dir(path: Path, *, origin: str) -> Path:
    """`path` with symlinks resolved, created 0700 where missing, after checking that no
    other user can write it or replace it (module docstring). `origin` says where the path
    came from, for messages.

    Raises:
        MoeEpUsageError: `path` is relative.
        MoeEpUnavailableError: a directory cannot be created or inspected, or is not private.
    """
    if not path.is_absolute():
        raise MoeEpUsageError(f"cache directory {str(path)!r} ({origin}) must be an absolute path")
    real = Path(os.path.realpath(path))
    for p in [*reversed(real.parents), real]:
        created = _make_dir(p, path, origin)
        try:
            st = os.lstat(p)
        except OSError as exc:
            raise MoeEpUnavailableError(
                f"cannot inspect cache directory {p} ({origin}): {exc.strerror}"
            ) from exc
        if not stat.S_ISDIR(st.st_mode):
            raise MoeEpUnavailableError(
                f"cache directory {path} ({origin}): {p} is not a directory"
            )
        reason = _not_private(st) if p == real or created else _not_safe_above(st)
        if reason:
            raise MoeEpUnavailableError(
                f"cache directory {path} ({origin}) is not private: {p} {reason}; make it "
                "owned by you and writable only by you (chown, chmod go-w) or use another "
                "directory"
            )
    return real


def _make_dir(p: Path, path: Path, origin: str) -> bool:
    """Create `p` 0700 when it does not exist; whether this call created it."""
    try:
        os.lstat(p)
        return False
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise MoeEpUnavailableError(
            f"cannot inspect cache directory {p} ({origin}): {exc.strerror}"
        ) from exc
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        return False  # made at the same moment by another process: checked as found
    except OSError as exc:
        raise MoeEpUnavailableError(
            f"cannot create cache directory {path} ({origin}): {p}: {exc.strerror}"
        ) from exc
    os.chmod(p, 0o700)  # mkdir's mode is masked by the umask
    return True


def _writers(mode: int) -> str:
    who = [w for bit, w in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if mode & bit]
    return " and ".join(who)


def _not_private(st: os.stat_result) -> str | None:
    """Why a directory we write into, or a file we load, is not ours alone (None: it is)."""
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & _GROUP_OTHER_WRITE:
        mode = stat.S_IMODE(st.st_mode)
        return f"is writable by {_writers(st.st_mode)} (mode {mode:04o})"
    return None


def _not_safe_above(st: os.stat_result) -> str | None:
    """Why an existing directory above the cache lets another user swap what is below it
    (None: it does not)."""
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}, neither this user (uid {os.geteuid()}) nor root"
    if st.st_mode & _GROUP_OTHER_WRITE and not st.st_mode & stat.S_ISVTX:
        mode = stat.S_IMODE(st.st_mode)
        return f"is writable by {_writers(st.st_mode)} and not sticky (mode {mode:04o})"
    return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _tree_files(top: Path) -> dict[str, Path]:
    """Every regular file under `top` by its relative posix path, after checking that every
    directory and file there is private and nothing else is there."""
    files: dict[str, Path] = {}
    pending = [top]
    while pending:
        d = pending.pop()
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise _Untrusted(f"{d} is not a directory")
        if reason := _not_private(st):
            raise _Untrusted(f"{d} {reason}")
        with os.scandir(d) as it:
            for item in it:
                p = Path(item.path)
                st = os.lstat(p)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(p)
                elif not stat.S_ISREG(st.st_mode):
                    raise _Untrusted(f"{p} is not a regular file or a directory")
                elif reason := _not_private(st):
                    raise _Untrusted(f"{p} {reason}")
                else:
                    files[p.relative_to(top).as_posix()] = p
    return files


def entry_problem(entry: Path) -> str | None:
    """Why the cache entry `entry` may not be used (None: it may); "absent" when missing."""
    try:
        files = _tree_files(entry)
        manifest = files.pop(MANIFEST, None)
        if manifest is None:
            raise _Untrusted(f"{entry} has no {MANIFEST}")
        try:
            recorded = json.loads(manifest.read_text())["sha256"]
        except (ValueError, KeyError, TypeError) as exc:
            raise _Untrusted(f"{manifest} is not a manifest ({exc})") from exc
        if not isinstance(recorded, dict) or set(recorded) != set(files):
            extra = sorted(set(files) - set(recorded or ()))
            missing = sorted(set(recorded or ()) - set(files))
            raise _Untrusted(f"{entry}: files not in its manifest {extra}, missing {missing}")
        for rel, p in sorted(files.items()):
            if _sha256(p) != recorded[rel]:
                raise _Untrusted(f"{p} does not match the sha256 recorded when it was built")
    except FileNotFoundError as exc:
        return "absent" if exc.filename == str(entry) else f"{exc.filename} vanished"
    except _Untrusted as exc:
        return str(exc)
    except OSError as exc:
        return f"{exc.filename}: {exc.strerror}"
    return None


def find_entry(root: Path, name: str) -> Path | None:
    """`root/name` when it is a usable entry (`entry_problem` is None), else None."""
    entry = root / name
    return entry if entry_problem(entry) is None else None


def stage(root: Path, name: str, build: Callable[[Path], None]) -> Path:
    """Run `build(d)` in a new private directory `d` beside `root/name`, drop group/other
    write from everything it made, record the manifest; returns `d` (for `publish`).

    Raises:
        RuntimeError: the build left something `entry_problem` refuses (a symlink, say).
        Whatever `build` raises (the directory is removed first).
    """
    staged = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))
    try:
        build(staged)
        for dirpath, _, names in os.walk(staged):
            os.chmod(dirpath, 0o700)
            for n in names:
                p = os.path.join(dirpath, n)
                if not os.path.islink(p):
                    os.chmod(p, stat.S_IMODE(os.lstat(p).st_mode) & ~_GROUP_OTHER_WRITE)
        digests = {rel: _sha256(p) for rel, p in sorted(_tree_files(staged).items())}
        fd = os.open(staged / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"sha256": digests}, f, indent=1, sort_keys=True)
        if problem := entry_problem(staged):
            raise RuntimeError(f"the build of cache entry {name} is not usable: {problem}")
    except BaseException:
        discard(staged)
        raise
    return staged


def publish(staged: Path, entry: Path, *, replace: bool = False) -> Path:
    """Rename `staged` to `entry` in one step and return `entry`.

    An existing usable entry (a concurrent builder's) is kept and `staged` removed, unless
    `replace` (the caller found that entry wanting); an unusable one is moved aside first.

    Raises:
        MoeEpUnavailableError: other processes kept replacing `entry` (three attempts).
    """
    for _ in range(3):
        try:
            os.rename(staged, entry)
            return entry
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                discard(staged)
                raise
        if not replace and entry_problem(entry) is None:
            discard(staged)
            return entry
        replace = False
        aside = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", suffix=".stale", dir=entry.parent))
        with contextlib.suppress(FileNotFoundError):  # another process moved it already
            os.rename(entry, aside / "entry")
        discard(aside)
    discard(staged)
    raise MoeEpUnavailableError(f"cache entry {entry} kept being replaced while publishing it")


def discard(path: Path) -> None:
    """Remove `path` (a directory tree, never followed through symlinks); errors ignored."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)

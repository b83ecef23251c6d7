"""The tuning cache file: winners keyed by (kernel, arch, shape bucket, world size) with the
library and dependency versions that measured them, and the timings of unfinished sweeps.

One JSON file, `<dir>/tuning.json`, `<dir>` = MOE_EP_TUNING_CACHE or
`$HOME/.cache/moe-ep/tuning` (private, as the build caches: `moe_ep.cache_trust`). Every
write is read-modify-write under an exclusive lock on `tuning.json.lock`, then a complete
new file replaces the old one in one step (`os.replace`): a reader sees the old file or
the new one, never a mix, and concurrent writers do not lose each other's entries. A file
that is not a tuning cache, or an entry that does not parse, is reported (a warning naming
the file and the key) and ignored; an entry measured under other versions is stale:
reported and ignored, never trusted.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import os
import platform
import re
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = "moe-ep-tuning/1"
FILE = "tuning.json"


class TuningCacheWarning(UserWarning):
    """A corrupted or stale tuning-cache entry was ignored."""


def tokens_bucket(tokens: int) -> int:
    """The shape bucket of a live-token count: the next power of two (1 for 0 or 1)."""
    return 1 << max(0, int(tokens) - 1).bit_length()


def _requirements(dist: str) -> list[str]:
    """The names of `dist`'s unconditional direct requirements (extras left out)."""
    try:
        reqs = importlib.metadata.requires(dist) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    names = []
    for req in reqs:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if match and not re.search(r"\bextra\s*==", req):
            names.append(match.group())
    return names


def _distributions_of(top: str) -> list[str]:
    """The distributions that ship the top-level module `top`: from their file lists, else
    (an editable install lists no module files) those whose registered kernels live there."""
    found = list(importlib.metadata.packages_distributions().get(top, []))
    if found:
        return found
    for ep in importlib.metadata.entry_points(group="moe_ep.backends"):
        if ep.value.split(":", 1)[0].split(".", 1)[0] == top and ep.dist is not None:
            found.append(ep.dist.name)
    return list(dict.fromkeys(found))


def versions(kernel_module: str | None = None) -> dict[str, str]:
    """The versions an entry was measured under: moe-ep-core, torch, and, when the kernel's
    module is not core, the distribution that ships it (a backend package) and that
    package's own requirements (the CuTe DSL, NVSHMEM, the drops: what its speed depends
    on)."""
    import torch

    out: dict[str, str] = {"torch": str(torch.__version__)}
    names = ["moe-ep-core"]
    top = (kernel_module or "").split(".", 1)[0]
    if top and top != "moe_ep":
        backends = _distributions_of(top)
        names += backends
        names += [r for b in backends for r in _requirements(b) if r not in names]
    for name in dict.fromkeys(names):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def arch_of(cuda_ordinal: int | None) -> str:
    """The arch part of a key: `cuda:sm_XY` (that device's capability) or `cpu:<machine>`
    with torch's intra-op thread count (the portable kernels' thread split depends on it),
    and `:eager` where the bits depend on the thread count (no fused CPU library: a winner
    tuned with it, e.g. its `cpu_threads`, is not read there)."""
    import torch

    if cuda_ordinal is not None:
        major, minor = torch.cuda.get_device_capability(cuda_ordinal)
        return f"cuda:sm_{major}{minor}"
    from moe_ep.backends.portable.kernel import thread_count_keeps_bits

    eager = "" if thread_count_keeps_bits() else ":eager"
    return f"cpu:{platform.machine() or 'unknown'}:threads={torch.get_num_threads()}{eager}"


@dataclass(frozen=True)
class TuningKey:
    """What a winner is valid for; `versions` are checked, not part of the identity (a
    version change makes an entry stale, reported, instead of silently absent)."""

    kernel: str
    arch: str
    bucket: tuple[int, int, int, int]
    """(tokens bucket of the tokens per rank, H, I, E): what a layer knows at construction
    (its top-k comes with each forward)."""
    world_size: int
    versions: Mapping[str, str]

    def ident(self) -> str:
        t, h, i, e = self.bucket
        return f"{self.kernel}|{self.arch}|T<={t} H={h} I={i} E={e}|ws={self.world_size}"


def cache_path(env: Mapping[str, str] | None = None, *, create: bool = False) -> Path:
    """The cache file's path; `create` makes (and checks) its private directory.

    Raises:
        MoeEpUsageError: MOE_EP_TUNING_CACHE is not an absolute path.
        MoeEpUnavailableError: (create) the directory is not private or HOME is unusable.
    """
    from moe_ep import cache_trust
    from moe_ep import env as moe_env

    value = moe_env.tuning_cache_dir(env)
    if create:
        return cache_trust.cache_dir("MOE_EP_TUNING_CACHE", value, "tuning") / FILE
    if value is not None:
        return Path(value) / FILE
    home = moe_env.home_dir(env) or "~"
    return Path(home) / ".cache" / "moe-ep" / "tuning" / FILE


class TuningCache:
    """The cache file at `path` (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _read(self) -> dict[str, Any]:
        """The file's document; a missing file is empty, a corrupted one is reported and
        read as empty."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {"schema": SCHEMA, "entries": {}, "sweeps": {}}
        except OSError as exc:
            self._report(f"cannot be read ({exc.strerror})")
            return {"schema": SCHEMA, "entries": {}, "sweeps": {}}
        try:
            doc = json.loads(text)
        except ValueError as exc:
            self._report(f"is not JSON ({exc})")
            return {"schema": SCHEMA, "entries": {}, "sweeps": {}}
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            self._report(f"is not a tuning cache of schema {SCHEMA!r}")
            return {"schema": SCHEMA, "entries": {}, "sweeps": {}}
        for part in ("entries", "sweeps"):
            if not isinstance(doc.get(part), dict):
                doc[part] = {}
        return doc

    def _report(self, what: str, key: str | None = None) -> None:
        where = f"entry {key!r} of " if key else ""
        warnings.warn(
            f"tuning cache: {where}{self.path} {what}: ignored (defaults used; `moe-ep tune` "
            "rewrites it)",
            TuningCacheWarning,
            stacklevel=3,
        )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The document under the exclusive write lock; written back atomically on exit."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = self.path.with_name(self.path.name + ".lock")
        with open(lock, "a") as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                doc = self._read()
                yield doc
                self._replace(doc)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _replace(self, doc: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def count(self) -> int:
        """Entries in the file (0 when missing or corrupted, which is reported)."""
        return len(self._read()["entries"])

    def lookup(self, key: TuningKey) -> dict[str, Any] | None:
        """The winner's knobs for `key` (JSON values), or None: absent, or reported and
        ignored when its entry does not parse or was measured under other versions."""
        ident = key.ident()
        entry = self._read()["entries"].get(ident)
        if entry is None:
            return None
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("knobs"), dict)
            and isinstance(entry.get("versions"), dict)
        ):
            self._report("does not parse (knobs / versions missing)", ident)
            return None
        if entry["versions"] != dict(key.versions):
            changed = sorted(
                k
                for k in {*entry["versions"], *key.versions}
                if entry["versions"].get(k) != key.versions.get(k)
            )
            self._report(
                "is stale: measured under other versions of " + ", ".join(changed)
                + f" ({ {k: entry['versions'].get(k) for k in changed} } then, "
                f"{ {k: key.versions.get(k) for k in changed} } now)",
                ident,
            )  # fmt: skip
            return None
        return dict(entry["knobs"])

    def record(
        self,
        key: TuningKey,
        knobs: Mapping[str, Any],
        seconds: float,
        timings: Mapping[str, float | None],
    ) -> None:
        """Write the winner of `key` (replacing any entry) and drop its unfinished sweep."""
        with self._locked() as doc:
            doc["entries"][key.ident()] = {
                "knobs": dict(knobs),
                "seconds": seconds,
                "timings": dict(timings),
                "versions": dict(key.versions),
            }
            doc["sweeps"].pop(key.ident(), None)

    def sweep(self, key: TuningKey) -> dict[str, float]:
        """Timings of the candidates an unfinished sweep of `key` measured (candidate id ->
        seconds), under the same versions; else empty."""
        got = self._read()["sweeps"].get(key.ident())
        if not isinstance(got, dict) or got.get("versions") != dict(key.versions):
            return {}
        timings = got.get("timings")
        if not isinstance(timings, dict):
            return {}
        return {k: float(v) for k, v in timings.items() if isinstance(v, int | float)}

    def save_timing(self, key: TuningKey, candidate: str, seconds: float) -> None:
        """Record one measured candidate of the sweep of `key` (what a resumed sweep skips)."""
        with self._locked() as doc:
            got = doc["sweeps"].get(key.ident())
            if not isinstance(got, dict) or got.get("versions") != dict(key.versions):
                got = {"versions": dict(key.versions), "timings": {}}
            got["timings"][candidate] = seconds
            doc["sweeps"][key.ident()] = got

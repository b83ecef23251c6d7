"""The three kinds of source a drop is fetched from: `git`, `pypi`, `path`.

Each turns a `Pin` into a `Tree` (the files under the pin's subdir) without touching the
drop, so a failure anywhere leaves the drop exactly as it was. Fetched artifacts and git
mirrors are cached under `$MOE_EP_VENDOR_CACHE` (default `~/.cache/moe-ep-vendor`):
PyPI artifacts keyed by sha256, git mirrors keyed by the URL.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from vendorlib.errors import SourceError, UsageError
from vendorlib.lockfile import Tree
from vendorlib.meta import DEFAULT_INDEX, Pin
from vendorlib.progress import Progress

__all__ = [
    "cache_dir",
    "complete_pin",
    "fetch_tree",
    "head_revision",
    "pin_at",
]

_TIMEOUT_S = 60.0
_CHUNK = 1 << 20


def cache_dir() -> Path:
    """`$MOE_EP_VENDOR_CACHE`, else `$XDG_CACHE_HOME/moe-ep-vendor`, else `~/.cache/...`."""
    explicit = os.environ.get("MOE_EP_VENDOR_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-ep-vendor"


def _under(path: str, subdir: str) -> str | None:
    """`path` relative to `subdir`, or None when it lies outside."""
    if not subdir:
        return path
    prefix = subdir.rstrip("/") + "/"
    return path[len(prefix) :] if path.startswith(prefix) else None


# --------------------------------------------------------------------------- git


def _git(args: list[str], cwd: Path | None = None, input_: bytes | None = None) -> bytes:
    cmd = ["git", *args]
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    try:
        proc = subprocess.run(cmd, cwd=cwd, input=input_, capture_output=True, env=env, timeout=600)
    except FileNotFoundError:
        raise SourceError("git is not installed; the git source needs it") from None
    if proc.returncode != 0:
        raise SourceError(
            f"`{' '.join(cmd)}` exited {proc.returncode}: "
            f"{proc.stderr.decode(errors='replace').strip()}"
        )
    return proc.stdout


def _git_url(url: str, root: Path) -> str:
    # A relative local path is relative to the repository root, not the current directory.
    if "://" in url or url.startswith("git@"):
        return url
    path = Path(url)
    return str(path if path.is_absolute() else (root / path).resolve())


def _mirror(url: str, need: str | None, progress: Progress) -> Path:
    mirror = cache_dir() / "git" / (hashlib.sha256(url.encode()).hexdigest()[:24] + ".git")
    if not mirror.is_dir():
        mirror.parent.mkdir(parents=True, exist_ok=True)
        tmp = mirror.with_name(mirror.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        with progress.task(f"clone {url}", None):
            _git(["clone", "--mirror", "--quiet", url, str(tmp)])
        os.replace(tmp, mirror)
    elif need is None or not _has_commit(mirror, need):
        with progress.task(f"fetch {url}", None):
            _git(["fetch", "--quiet", "--prune", "origin", "+refs/*:refs/*"], cwd=mirror)
    return mirror


def _has_commit(mirror: Path, rev: str) -> bool:
    try:
        _git(["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=mirror)
    except SourceError:
        return False
    return True


def _git_tree(pin: Pin, root: Path, progress: Progress) -> Tree:
    url = _git_url(pin.fields["url"], root)
    commit = pin.fields["commit"]
    mirror = _mirror(url, commit, progress)
    if not _has_commit(mirror, commit):
        raise SourceError(f"commit {commit} does not exist in {url}")
    subdir = pin.subdir
    listing = _git(["ls-tree", "-r", "-z", "--full-tree", commit, "--", subdir or "."], cwd=mirror)
    items: list[tuple[str, str, str]] = []
    for record in listing.split(b"\0"):
        if not record:
            continue
        meta, path_b = record.split(b"\t", 1)
        mode, kind, sha = meta.decode().split()
        path = path_b.decode("utf-8", errors="surrogateescape")
        rel = _under(path, subdir)
        if rel is None:
            continue
        if kind == "commit":
            raise SourceError(
                f"{url}@{commit}: {path} is a submodule, whose files the drop would silently "
                "lack; vendor the submodule's repository as its own drop"
            )
        if mode == "120000":
            raise SourceError(f"{url}@{commit}: {path} is a symlink; drops hold regular files only")
        items.append((rel, mode, sha))
    if not items:
        raise SourceError(f"subdir {subdir!r} is missing or empty in {url} at {commit}")
    tree: Tree = {}
    with progress.task(f"extract {len(items)} files", len(items)) as advance:
        out = _git(
            ["cat-file", "--batch"],
            cwd=mirror,
            input_="".join(f"{s}\n" for _, _, s in items).encode(),
        )
        buf = io.BytesIO(out)
        for rel, mode, _sha in items:
            header = buf.readline().split()
            size = int(header[2])
            data = buf.read(size)
            buf.read(1)
            tree[rel] = (0o755 if mode == "100755" else 0o644, data)
            advance(1)
    return tree


def _git_head(pin: Pin, root: Path) -> str:
    url = _git_url(pin.fields["url"], root)
    ref = pin.fields.get("ref", "HEAD")
    out = _git(["ls-remote", url, ref]).decode().split()
    if not out:
        raise SourceError(f"{url} has no ref {ref!r}")
    return out[0]


def _git_resolve(pin: Pin, root: Path, rev: str, progress: Progress) -> str:
    url = _git_url(pin.fields["url"], root)
    mirror = _mirror(url, rev if re.fullmatch(r"[0-9a-f]{40}", rev) else None, progress)
    try:
        return _git(["rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=mirror).decode().strip()
    except SourceError:
        raise SourceError(f"revision {rev!r} does not exist in {url}") from None


# --------------------------------------------------------------------------- pypi


@dataclass(frozen=True)
class _IndexFile:
    filename: str
    url: str
    sha256: str


class _Anchors(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href") or ""
            self._text = []

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _index_url(pin: Pin) -> str:
    return (
        os.environ.get("MOE_EP_VENDOR_INDEX_URL") or pin.fields.get("index") or DEFAULT_INDEX
    ).rstrip("/")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _open(url: str) -> Any:
    req = urllib.request.Request(
        url,
        headers={
            "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1",
            "User-Agent": "moe-ep-vendor/1",
        },
    )
    try:
        return urllib.request.urlopen(req, timeout=_TIMEOUT_S)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise SourceError(f"cannot reach {url}: {exc}") from None


def _project_files(pin: Pin) -> list[_IndexFile]:
    base = f"{_index_url(pin)}/{_normalize(pin.fields['distribution'])}/"
    if base.startswith("file://"):
        local = Path(urllib.parse.urlparse(base).path)
        base_file = (local / "index.html").as_uri()
        body, ctype = _read_url(base_file), "text/html"
        base = base_file
    else:
        with _open(base) as resp:
            body = resp.read()
            ctype = resp.headers.get("Content-Type", "")
    files: list[_IndexFile] = []
    if "json" in ctype:
        for f in json.loads(body)["files"]:
            files.append(
                _IndexFile(
                    f["filename"],
                    urllib.parse.urljoin(base, f["url"]),
                    f["hashes"].get("sha256", ""),
                )
            )
        return files
    parser = _Anchors()
    parser.feed(body.decode("utf-8", errors="replace"))
    for href, text in parser.links:
        url, _, frag = href.partition("#")
        sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else ""
        name = text or urllib.parse.unquote(url.rsplit("/", 1)[-1])
        files.append(_IndexFile(name, urllib.parse.urljoin(base, url), sha))
    return files


def _read_url(url: str) -> bytes:
    with _open(url) as resp:
        data: bytes = resp.read()
        return data


def _version_of(filename: str, distribution: str) -> str | None:
    norm = re.sub(r"[-_.]+", "_", distribution).lower()
    m = re.match(r"(?P<name>[^-]+)-(?P<ver>[^-]+?)(-.*\.whl|\.tar\.gz|\.zip)\Z", filename)
    if not m or re.sub(r"[-_.]+", "_", m["name"]).lower() != norm:
        return None
    return m["ver"]


def _artifact_for(pin: Pin, version: str) -> _IndexFile:
    """The index entry of the same kind of artifact as the pin's, at `version`."""
    old = pin.fields["artifact"]
    files = _project_files(pin)
    want = old.replace(pin.fields["version"], version, 1)
    for f in files:
        if f.filename == want:
            return f
    kind = ".whl" if old.endswith(".whl") else ".tar.gz"
    same_kind = [
        f
        for f in files
        if _version_of(f.filename, pin.fields["distribution"]) == version
        and f.filename.endswith(kind)
    ]
    if len(same_kind) == 1:
        return same_kind[0]
    raise SourceError(
        f"{pin.fields['distribution']} {version}: no artifact like {want!r} on {_index_url(pin)}"
        f" (found {sorted(f.filename for f in files if version in f.filename) or 'none'})"
    )


def _download(pin: Pin, progress: Progress) -> Path:
    filename, sha = pin.fields["artifact"], pin.fields["sha256"]
    target = cache_dir() / "pypi" / sha / filename
    if target.is_file() and _sha256_file(target) == sha:
        return target
    entry = _artifact_for(pin, pin.fields["version"])
    if entry.sha256 and entry.sha256 != sha:
        raise SourceError(
            f"{filename}: the index lists sha256 {entry.sha256}, the pin says {sha}; refusing it"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + f".part{os.getpid()}")
    h = hashlib.sha256()
    try:
        with _open(entry.url) as resp, open(part, "wb") as out:
            total = int(resp.headers.get("Content-Length") or 0) or None
            with progress.task(f"fetch {filename}", total) as advance:
                while chunk := resp.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    advance(len(chunk))
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise SourceError(f"download of {entry.url} failed: {exc}") from None
    if h.hexdigest() != sha:
        part.unlink(missing_ok=True)
        raise SourceError(f"{filename}: sha256 is {h.hexdigest()}, the pin says {sha}")
    os.replace(part, target)
    return target


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _extract(artifact: Path, subdir: str, progress: Progress) -> Tree:
    tree: Tree = {}
    name = artifact.name
    if name.endswith((".whl", ".zip")):
        with zipfile.ZipFile(artifact) as zf:
            infos = [
                i
                for i in zf.infolist()
                if not i.is_dir() and _under(i.filename, subdir) is not None
            ]
            for info in infos:
                # The Unix file type sits in the high bits (0 when the archiver recorded none);
                # a symlink entry's data is its target, which must not become a regular file.
                kind = stat.S_IFMT(info.external_attr >> 16)
                if kind not in (0, stat.S_IFREG):
                    what = "a symlink" if kind == stat.S_IFLNK else f"file type {oct(kind)}"
                    raise SourceError(
                        f"{name}: entry {info.filename} is {what}; drops hold regular files only"
                    )
            with progress.task(f"extract {len(infos)} files", len(infos)) as advance:
                for info in infos:
                    rel = _under(info.filename, subdir) or info.filename
                    mode = (info.external_attr >> 16) & 0o777
                    tree[rel] = (0o755 if mode & 0o111 else 0o644, zf.read(info))
                    advance(1)
    elif name.endswith((".tar.gz", ".tgz")):
        with tarfile.open(artifact, "r:gz") as tf:
            members: list[tuple[str, tarfile.TarInfo]] = []
            for m in tf.getmembers():
                # sdists wrap everything in one `<name>-<version>/` directory: strip it.
                inner = m.name.split("/", 1)[1] if "/" in m.name else ""
                under = _under(inner, subdir)
                if under is None or m.isdir():
                    continue
                rel = under
                if not m.isfile():
                    raise SourceError(
                        f"{name}: {m.name} is not a regular file; drops hold regular files only"
                    )
                members.append((rel, m))
            with progress.task(f"extract {len(members)} files", len(members)) as advance:
                for rel, m in members:
                    fh = tf.extractfile(m)
                    data = fh.read() if fh else b""
                    tree[rel] = (0o755 if m.mode & 0o111 else 0o644, data)
                    advance(1)
    else:
        raise UsageError(f"{name}: unsupported artifact type (expected .whl, .zip or .tar.gz)")
    if not tree:
        raise SourceError(f"subdir {subdir!r} is missing or empty in {name}")
    return tree


def _pypi_latest(pin: Pin) -> str:
    from packaging.version import InvalidVersion, Version

    versions: set[Version] = set()
    for f in _project_files(pin):
        v = _version_of(f.filename, pin.fields["distribution"])
        if v:
            try:
                versions.add(Version(v))
            except InvalidVersion:
                continue
    current = Version(pin.fields["version"])
    stable = {v for v in versions if not v.is_prerelease or current.is_prerelease}
    if not stable:
        raise SourceError(f"{pin.fields['distribution']}: no versions found on {_index_url(pin)}")
    return str(max(stable))


# --------------------------------------------------------------------------- path


def _path_root(pin: Pin, root: Path) -> Path:
    p = Path(pin.fields["path"])
    return p if p.is_absolute() else root / p


def _path_tree(pin: Pin, root: Path, progress: Progress) -> Tree:
    base = _path_root(pin, root)
    top = base / pin.subdir if pin.subdir else base
    if not top.is_dir():
        raise SourceError(
            f"{top}: not a directory (source path {pin.fields['path']!r}, subdir {pin.subdir!r})"
        )
    files: list[Path] = []
    # os.walk, not rglob: a symlinked directory must be refused, not silently left out.
    for dirpath, dirnames, filenames in os.walk(top):
        for d in sorted(dirnames):
            if os.path.islink(os.path.join(dirpath, d)):
                raise SourceError(
                    f"{Path(dirpath, d)}: a symlink to a directory; drops hold regular files only"
                )
        files += [Path(dirpath, f) for f in filenames]
    files.sort()
    tree: Tree = {}
    with progress.task(f"copy {len(files)} files", len(files)) as advance:
        for p in files:
            if p.is_symlink() or not p.is_file():
                what = "a symlink" if p.is_symlink() else "not a regular file"
                raise SourceError(f"{p}: {what}; drops hold regular files only")
            tree[p.relative_to(top).as_posix()] = (
                0o755 if p.stat().st_mode & 0o111 else 0o644,
                p.read_bytes(),
            )
            advance(1)
    if not tree:
        raise SourceError(f"{top}: empty")
    return tree


# --------------------------------------------------------------------------- dispatch


def fetch_tree(pin: Pin, root: Path, progress: Progress) -> Tree:
    """All files under the pin's subdir, as `{path relative to subdir: (mode, bytes)}`.

    Raises `SourceError` when the source cannot be reached, lacks the revision or subdir,
    or its artifact fails the pinned sha256.
    """
    if pin.kind == "git":
        return _git_tree(pin, root, progress)
    if pin.kind == "pypi":
        return _extract(_download(pin, progress), pin.subdir, progress)
    return _path_tree(pin, root, progress)


def head_revision(pin: Pin, root: Path) -> str:
    """Upstream's newest revision: git `ref` (default HEAD), latest PyPI version, or the path."""
    if pin.kind == "git":
        return _git_head(pin, root)
    if pin.kind == "pypi":
        return _pypi_latest(pin)
    return pin.fields["path"]


def pin_at(pin: Pin, root: Path, rev: str, progress: Progress, sha256: str | None = None) -> Pin:
    """The same source at another revision (commit or ref, PyPI version, or directory)."""
    if pin.kind == "git":
        return pin.with_fields(commit=_git_resolve(pin, root, rev, progress))
    if pin.kind == "pypi":
        if rev == pin.fields["version"]:
            new = pin
        else:
            entry = _artifact_for(pin, rev)
            if not (sha256 or entry.sha256):
                raise SourceError(f"{entry.filename}: the index gives no sha256; pass --sha256")
            new = pin.with_fields(
                version=rev, artifact=entry.filename, sha256=sha256 or entry.sha256
            )
        return new.with_fields(sha256=sha256) if sha256 else new
    return pin.with_fields(path=rev)


def complete_pin(pin: Pin, root: Path, progress: Progress) -> Pin:
    """Fill what `add` may leave out: a git commit from a ref; a PyPI artifact and sha256.

    A PyPI pin without `artifact` takes the version's only wheel (else its sdist); without
    `sha256` it takes the index's digest, which the download then checks.
    """
    if pin.kind == "git":
        return pin.with_fields(
            commit=_git_resolve(pin, root, pin.fields.get("commit", "HEAD"), progress)
        )
    if pin.kind != "pypi":
        return pin
    version = pin.fields["version"]
    files = [
        f
        for f in _project_files(pin)
        if _version_of(f.filename, pin.fields["distribution"]) == version
    ]
    artifact = pin.fields.get("artifact")
    if artifact:
        chosen = [f for f in files if f.filename == artifact]
    else:
        chosen = [f for f in files if f.filename.endswith(".whl")] or [
            f for f in files if f.filename.endswith(".tar.gz")
        ]
    if len(chosen) != 1:
        raise SourceError(
            f"{pin.fields['distribution']}=={version}: cannot choose one artifact from "
            f"{sorted(f.filename for f in files) or 'none'} on {_index_url(pin)}; pass --artifact"
        )
    sha = pin.fields.get("sha256") or chosen[0].sha256
    if not sha:
        raise SourceError(f"{chosen[0].filename}: the index gives no sha256; pass --sha256")
    return pin.with_fields(artifact=chosen[0].filename, sha256=sha)

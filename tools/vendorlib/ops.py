"""Commands that fetch or change drops: `add`, `sync`, `pull-file`, `diff`, `outdated`.

They return JSON-ready dicts; the CLI only formats them (the offline checks are in `checks`).

Every command that changes a drop builds the new state completely aside (a staging directory
inside the drop, `staging.Staging`) and swaps it in all at once, so a failure leaves the drop
as it was.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from vendorlib.checks import check_tree, problem, today
from vendorlib.drops import Drop, load_drop
from vendorlib.errors import MismatchError, SourceError, UsageError
from vendorlib.globs import select
from vendorlib.history import earlier_lock_matching
from vendorlib.lockfile import (
    LOCK_NAME,
    FileEntry,
    Lock,
    Tree,
    diff_entries,
    entries_of,
    entry_of,
    load_lock,
    scan_dir,
    tree_digest,
    write_lock,
)
from vendorlib.meta import (
    META_NAME,
    NOT_RECORDED,
    DropMeta,
    License,
    Origin,
    Pending,
    Pin,
    write_meta,
)
from vendorlib.patching import apply_patch, make_patch, reverse_patch
from vendorlib.paths import inside, unsafe_reason
from vendorlib.progress import Progress
from vendorlib.sources import fetch_tree, head_revision, pin_at
from vendorlib.staging import Staging, sweep_stale
from vendorlib.templates import (
    GITIGNORE,
    HATCH_BUILD,
    is_python_tree,
    render_body,
    render_pyproject,
    shim_files,
)

__all__ = ["add", "diff", "outdated", "pull_file", "sync"]

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _filtered(tree: Tree, meta: DropMeta) -> Tree:
    for p in tree:
        why = unsafe_reason(p)
        if why:
            raise SourceError(
                f"the source holds an unsafe path {p!r} ({why}); refusing to write it"
            )
    return {p: v for p, v in tree.items() if select(p, meta.include, meta.exclude)}


def _pin_entries(lock: Lock, meta: DropMeta) -> dict[str, FileEntry]:
    """The lock's entries as the pin itself has them (pending files at their `from` bytes)."""
    out = dict(lock.files)
    for p in meta.pending:
        if p.path in out:
            out[p.path] = replace(out[p.path], sha256=p.from_sha256)
    return out


# --------------------------------------------------------------------------- writing trees


def _write_file(path: Path, mode: int, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)


def _write_tree(dest: Path, tree: Tree, progress: Progress) -> None:
    """Write `tree` under `dest` (a path inside a staging directory)."""
    dest.mkdir()
    with progress.task(f"write {len(tree)} files", len(tree)) as advance:
        for rel in sorted(tree):
            mode, data = tree[rel]
            _write_file(dest / rel, mode, data)
            advance(1)


def _patch_path(drop_dir: Path, p: Pending) -> Path:
    """Where entry `p`'s patch lives; refused when it would leave the drop."""
    return inside(drop_dir, p.patch, f"[[pending]] {p.path} patch", "patches/x.patch")


# --------------------------------------------------------------------------- sync


def _apply_pending(
    tree: Tree, pending: tuple[Pending, ...], drop_dir: Path, absorb: bool, new_rev: str
) -> tuple[Tree, list[Pending], list[Pending]]:
    """Re-apply pending patches on `tree`; with `absorb`, drop entries the tree already has."""
    tree = dict(tree)
    kept: list[Pending] = []
    absorbed: list[Pending] = []
    for p in pending:
        if p.path not in tree:
            raise MismatchError(f"pending {p.path}: the pinned source has no such file")
        mode, data = tree[p.path]
        sha = _sha256(data)
        if absorb and sha == p.to_sha256:
            absorbed.append(p)
            continue
        if sha != p.from_sha256:
            raise MismatchError(
                f"pending {p.path}: the pin's bytes have sha256 {sha}, not the entry's from_sha256 "
                f"{p.from_sha256} (nor its to_sha256); the patch no longer applies. Take the file "
                "again with `pull-file` after syncing, or remove the entry"
            )
        patch_path = _patch_path(drop_dir, p)
        if not patch_path.is_file():
            raise MismatchError(f"pending {p.path}: patch file {p.patch} is missing")
        new = apply_patch(data, patch_path.read_text(encoding="utf-8"), p.path)
        if _sha256(new) != p.to_sha256:
            raise MismatchError(
                f"pending {p.path}: patch no longer reproduces: it gives sha256 {_sha256(new)}, "
                f"entry says to_sha256 {p.to_sha256}"
            )
        tree[p.path] = (mode, new)
        kept.append(replace(p, from_rev=new_rev) if absorb else p)
    return tree, kept, absorbed


def sync(
    root: Path,
    name: str,
    progress: Progress,
    to: str | None = None,
    force: bool = False,
    sha256: str | None = None,
) -> dict[str, Any]:
    """Materialize `src/` from the pin (or re-pin with `to`); atomic; refuses local edits."""
    drop = load_drop(root, name)
    meta = drop.meta
    lock = load_lock(drop.lock_path) if drop.lock_path.is_file() else None
    if sha256 is not None and to is None:
        raise UsageError("--sha256 only goes with --to (it pins the new artifact)")
    for p in meta.pending:  # before anything is read or deleted through them
        _patch_path(drop.dir, p)
    sweep_stale(drop.dir)

    if drop.src.exists() and not force:
        dirty = check_tree(drop, lock) if lock else [problem("lock", "", "no lock to compare")]
        # bytes of an earlier pin left by a pull or merge that moved the lock are no edits
        if dirty and (lock is None or earlier_lock_matching(root, drop) is None):
            shown = ", ".join(f"{d['check']} {d['path']}" for d in dirty[:5])
            raise MismatchError(
                f"{name}: src/ has local changes ({len(dirty)}: {shown}); "
                "fix them upstream or pass --force to discard them"
            )
        if not dirty and to is None and lock is not None and lock.pin == meta.source.identity():
            return {
                "name": name,
                "action": "up-to-date",
                "pin": meta.source.identity(),
                "files": len(lock.files),
            }

    if to is None and lock is not None and lock.pin != meta.source.identity():
        raise MismatchError(
            f"{name}: VENDOR.md pins {meta.source.identity()} but {drop.lock_path.name} was made "
            f"from {lock.pin}; re-pin with `uv run tools/vendor.py sync {name} --to <rev>`"
        )
    pin = pin_at(meta.source, root, to, progress, sha256) if to is not None else meta.source
    tree = _filtered(fetch_tree(pin, root, progress), meta)
    tree, kept, absorbed = _apply_pending(
        tree, meta.pending, drop.dir, to is not None, pin.revision
    )
    entries = entries_of(tree)

    if to is None and lock is not None:
        d = diff_entries(lock.files, entries)
        if any(d.values()):
            raise MismatchError(
                f"{name}: the pinned source's bytes differ from {drop.lock_path.name} ({d}); "
                "the pin no longer reproduces the lock"
            )

    pending_map = {p.path: p.to_sha256 for p in kept}
    with Staging(drop.dir) as stage:
        _write_tree(stage.path("src"), tree, progress)
        moves = [(stage.path("src"), drop.src)]
        if to is not None or lock is None:
            write_lock(stage.path(LOCK_NAME), name, pin.identity(), pending_map, entries)
            moves.append((stage.path(LOCK_NAME), drop.lock_path))
        if to is not None:
            new_meta = replace(meta, source=pin, sync_date=today(), pending=tuple(kept))
            write_meta(stage.dir, new_meta)
            moves.append((stage.path(META_NAME), drop.dir / META_NAME))
            for i, p in enumerate(absorbed):  # moved into staging: deleted with it
                patch = _patch_path(drop.dir, p)
                if patch.exists():
                    moves.append((stage.path(f"absorbed-{i}.patch"), patch))
        stage.commit(moves)
    return {
        "name": name,
        "action": "repinned" if to is not None else "materialized",
        "pin": pin.identity(),
        "files": len(entries),
        "tree_sha256": tree_digest(entries),
        "absorbed": [p.path for p in absorbed],
        "pending": sorted(pending_map),
    }


# --------------------------------------------------------------------------- add


def add(
    root: Path,
    name: str,
    pin: Pin,
    progress: Progress,
    *,
    description: str,
    spdx: str,
    package: str | None = None,
    distribution: str | None = None,
    consumers: tuple[str, ...] = (),
    include: tuple[str, ...] = ("**",),
    exclude: tuple[str, ...] = (),
    license_files: tuple[str, ...] = (),
    license_note: str = "",
    origin_repo: str | None = None,
    origin_commit: str | None = None,
) -> dict[str, Any]:
    """First import: fetch, then write src/, lock, VENDOR.md, pyproject, build hook and shim."""
    if not _NAME.match(name):
        raise UsageError(f"drop name {name!r} must be lower_snake_case, e.g. 'sm90_push_cuda'")
    drop_dir = root / "vendor" / name
    if drop_dir.exists() and any(drop_dir.iterdir()):
        raise UsageError(f"{drop_dir} already exists; use `sync --to` to move an existing drop")
    package = package or f"moe_ep_drop_{name}"
    distribution = distribution or "moe-ep-drop-" + name.replace("_", "-")
    if not license_files and not license_note:
        license_note = "The upstream tree has no license file; see the SPDX headers (`licenses`)."
    meta = DropMeta(
        name=name,
        description=description,
        origin=Origin(
            repo=origin_repo or (pin.fields["url"] if pin.kind == "git" else NOT_RECORDED),
            commit=origin_commit or (pin.fields["commit"] if pin.kind == "git" else NOT_RECORDED),
        ),
        source=pin,
        license=License(spdx=spdx, files=license_files, note=license_note),
        include=include,
        exclude=exclude,
        sync_date=today(),
        update=(
            f"uv run tools/vendor.py outdated {name}; uv run tools/vendor.py sync {name} --to <rev>"
        ),
        consumers=consumers,
        body=render_body(name),
    )
    tree = _filtered(fetch_tree(pin, root, progress), meta)  # before creating anything
    missing_lic = [f for f in license_files if f not in tree]
    if missing_lic:
        raise UsageError(f"license files {missing_lic} are not in the fetched tree")
    created = not drop_dir.exists()
    drop_dir.mkdir(parents=True, exist_ok=True)
    entries = entries_of(tree)
    try:
        with Staging(drop_dir) as stage:
            member = {
                ".gitignore": GITIGNORE,
                "hatch_build.py": HATCH_BUILD,
                "pyproject.toml": render_pyproject(distribution, package, description, spdx),
            }
            for rel, text in member.items():
                stage.path(rel).write_text(text, encoding="utf-8")
            shim = stage.path("shim") / package
            shim.mkdir(parents=True)
            for rel, text in shim_files(name, package, description, is_python_tree(tree)).items():
                (shim / rel).write_text(text, encoding="utf-8")
            _write_tree(stage.path("src"), tree, progress)
            write_lock(stage.path(LOCK_NAME), name, pin.identity(), {}, entries)
            write_meta(stage.dir, meta)
            names = [*member, "shim", "src", LOCK_NAME, META_NAME]
            stage.commit([(stage.path(n), drop_dir / n) for n in names])
    except BaseException:
        if created:
            shutil.rmtree(drop_dir, ignore_errors=True)
        raise
    return {
        "name": name,
        "action": "added",
        "dir": str(drop_dir),
        "distribution": distribution,
        "package": package,
        "pin": pin.identity(),
        "files": len(entries),
        "tree_sha256": tree_digest(entries),
    }


# --------------------------------------------------------------------------- diff / outdated


def _diff_text(
    left: Tree, right: Tree, subdir: str, lname: str, rname: str
) -> tuple[str, dict[str, list[str]]]:
    prefix = f"{subdir}/" if subdir else ""
    summary: dict[str, list[str]] = {"added": [], "removed": [], "modified": [], "mode": []}
    chunks: list[str] = []
    for path in sorted(set(left) | set(right)):
        lm, ld = left.get(path, (0, b""))
        rm, rd = right.get(path, (0, b""))
        if path not in left:
            summary["added"].append(path)
        elif path not in right:
            summary["removed"].append(path)
        elif ld != rd:
            summary["modified"].append(path)
        elif lm != rm:
            summary["mode"].append(path)
            chunks.append(f"mode {prefix}{path}: {oct(lm)} -> {oct(rm)}\n")
            continue
        else:
            continue
        a = f"a/{prefix}{path}" if path in left else "/dev/null"
        b = f"b/{prefix}{path}" if path in right else "/dev/null"
        try:
            la = ld.decode("utf-8").splitlines(keepends=True)
            lb = rd.decode("utf-8").splitlines(keepends=True)
        except UnicodeDecodeError:
            chunks.append(f"Binary files {a} and {b} differ\n")
            continue
        body = "".join(
            line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
            for line in difflib.unified_diff(la, lb, a, b, n=3)
        )
        chunks.append(body)
    header = f"# diff {lname} -> {rname}\n" if chunks else ""
    return header + "".join(chunks), summary


def _src_tree(drop: Drop) -> Tree:
    if not drop.src.is_dir():
        raise UsageError(
            f"{drop.name}: src/ is not materialized; run `uv run tools/vendor.py sync {drop.name}`"
        )
    tree: Tree = {}
    entries, _ = scan_dir(drop.src)
    for rel in entries:
        path = drop.src / rel
        tree[rel] = (path.stat().st_mode & 0o777, path.read_bytes())
    return tree


def diff(
    root: Path, name: str, progress: Progress, against: str | None = None, head: bool = False
) -> dict[str, Any]:
    """Unified diff from a revision (the pin, `against`, or upstream head) to the drop's src/."""
    drop = load_drop(root, name)
    pin = drop.meta.source
    if head and against:
        raise UsageError("--against and --head exclude each other")
    rev = head_revision(pin, root) if head else against
    left_pin = pin_at(pin, root, rev, progress) if rev is not None else pin
    left = _filtered(fetch_tree(left_pin, root, progress), drop.meta)
    right = _src_tree(drop)
    text, summary = _diff_text(
        left, right, pin.subdir, f"{left_pin.kind}:{left_pin.revision}", "src/"
    )
    return {
        "name": name,
        "from": left_pin.identity(),
        "to": "src/",
        "subdir": pin.subdir,
        "identical": not any(summary.values()),
        "summary": summary,
        "diff": text,
    }


def outdated(root: Path, name: str, progress: Progress) -> dict[str, Any]:
    """Is upstream ahead of the pin, and for which of the drop's files."""
    drop = load_drop(root, name)
    pin = drop.meta.source
    lock = load_lock(drop.lock_path)
    head = head_revision(pin, root)
    result: dict[str, Any] = {"name": name, "pinned": pin.revision, "head": head}
    if pin.kind != "path" and head == pin.revision:
        return result | {"ahead": False, "files": {"added": [], "removed": [], "modified": []}}
    head_pin = pin_at(pin, root, head, progress)
    new = entries_of(_filtered(fetch_tree(head_pin, root, progress), drop.meta))
    d = diff_entries(_pin_entries(lock, drop.meta), new)
    files = {"added": d["extra"], "removed": d["missing"], "modified": d["modified"] + d["mode"]}
    result["head"] = head_pin.revision
    return result | {"ahead": any(files.values()), "files": files}


# --------------------------------------------------------------------------- pull-file


def _patch_name(path: str) -> str:
    return "patches/" + path.replace("/", "__") + ".patch"


def pull_file(
    root: Path, name: str, path: str, rev: str, reason: str, progress: Progress
) -> dict[str, Any]:
    """Take one file from upstream revision `rev` and record it as a `[[pending]]` entry."""
    drop = load_drop(root, name)
    if not reason.strip():
        raise UsageError("--reason must say why the file is taken ahead of the pin")
    for p in drop.meta.pending:
        _patch_path(drop.dir, p)
    sweep_stale(drop.dir)
    lock = load_lock(drop.lock_path)
    problems = (
        check_tree(drop, lock) if drop.src.is_dir() else [problem("materialized", "src/", "")]
    )
    if problems:
        raise MismatchError(
            f"{name}: src/ must be materialized and verified before pull-file ({problems[:3]})"
        )
    if path not in lock.files:
        raise UsageError(
            f"{name}: {path!r} is not a file of the drop (only files the pin has can be pulled)"
        )
    new_pin = pin_at(drop.meta.source, root, rev, progress)
    tree = fetch_tree(new_pin, root, progress)
    if path not in tree:
        raise UsageError(f"{path!r} does not exist at {new_pin.kind}:{new_pin.revision}")
    current = (drop.src / path).read_bytes()
    new = tree[path][1]
    old_entry = next((p for p in drop.meta.pending if p.path == path), None)
    base = current
    if old_entry is not None:
        old_patch = _patch_path(drop.dir, old_entry).read_text(encoding="utf-8")
        base = apply_patch(current, reverse_patch(old_patch), path)
    if new == current:
        return {"name": name, "action": "unchanged", "path": path, "to_rev": new_pin.revision}
    others = tuple(p for p in drop.meta.pending if p.path != path)
    if new == base:
        # Upstream went back to the pinned bytes: the entry is no longer needed.
        pending: tuple[Pending, ...] = others
        entry = None
    else:
        entry = Pending(
            path=path,
            from_rev=drop.meta.source.revision,
            to_rev=new_pin.revision,
            from_sha256=_sha256(base),
            to_sha256=_sha256(new),
            patch=_patch_name(path),
            reason=reason,
            date=today(),
        )
        pending = (*others, entry)
    target = drop.src / path
    mode = target.stat().st_mode & 0o777
    files = dict(lock.files)
    files[path] = entry_of(path, mode, new)
    with Staging(drop.dir) as stage:
        _write_file(stage.path("file"), mode, new)
        write_lock(
            stage.path(LOCK_NAME), name, lock.pin, {p.path: p.to_sha256 for p in pending}, files
        )
        write_meta(stage.dir, replace(drop.meta, pending=pending))
        moves = [
            (stage.path("file"), target),
            (stage.path(LOCK_NAME), drop.lock_path),
            (stage.path(META_NAME), drop.dir / META_NAME),
        ]
        if entry is not None:
            stage.path("patch").write_text(make_patch(base, new, path), encoding="utf-8")
            patch = _patch_path(drop.dir, entry)
            patch.parent.mkdir(exist_ok=True)
            moves.append((stage.path("patch"), patch))
        elif old_entry is not None and _patch_path(drop.dir, old_entry).exists():
            # moved into staging: deleted with it
            moves.append((stage.path("old.patch"), _patch_path(drop.dir, old_entry)))
        stage.commit(moves)
    return {
        "name": name,
        "action": "pending-added" if entry else "pending-removed",
        "path": path,
        "from_rev": drop.meta.source.revision,
        "to_rev": new_pin.revision,
        "patch": entry.patch if entry else None,
    }

"""Offline checks of drops: `verify`, `status`, `lint`, `licenses` (JSON-ready dicts)."""

from __future__ import annotations

import datetime as _dt
import hashlib
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

from vendorlib.drops import Drop, drop_names, load_drop
from vendorlib.errors import MismatchError, UsageError
from vendorlib.lockfile import LOCK_NAME, Lock, diff_entries, load_lock, scan_dir, tree_digest
from vendorlib.meta import META_NAME, NOT_RECORDED, DropMeta
from vendorlib.patching import apply_patch, reverse_patch
from vendorlib.paths import inside
from vendorlib.templates import HATCH_BUILD, is_python_tree, shim_files

__all__ = ["check_tree", "licenses", "lint", "problem", "status", "today", "verify"]


def today() -> str:
    return _dt.datetime.now(_dt.UTC).date().isoformat()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def problem(check: str, path: str, detail: str) -> dict[str, str]:
    return {"check": check, "path": path, "detail": detail}


def check_tree(drop: Drop, lock: Lock) -> list[dict[str, str]]:
    actual, odd = scan_dir(drop.src)
    d = diff_entries(lock.files, actual)
    out = [problem("missing", p, "in the lock, not in src/") for p in d["missing"]]
    out += [problem("extra", p, "in src/, not in the lock") for p in d["extra"]]
    out += [
        problem("modified", p, f"sha256 {actual[p].sha256}, lock {lock.files[p].sha256}")
        for p in d["modified"]
    ]
    out += [
        problem("mode", p, f"mode {actual[p].mode}, lock {lock.files[p].mode}") for p in d["mode"]
    ]
    out += [problem("not-regular", p, "symlink or special file in src/") for p in odd]
    return out


def _check_pending(drop: Drop) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for p in drop.meta.pending:
        try:
            patch_path = inside(drop.dir, p.patch, f"[[pending]] {p.path} patch", "patches/x.patch")
            current = inside(drop.src, p.path, "[[pending]] path", "common/utils.py")
        except UsageError as exc:
            out.append(problem("pending", p.path, str(exc)))
            continue
        if not patch_path.is_file():
            out.append(problem("pending", p.path, f"patch file {p.patch} is missing"))
            continue
        if not current.is_file():
            continue  # reported as missing by the tree check
        data = current.read_bytes()
        if _sha256(data) != p.to_sha256:
            out.append(
                problem("pending", p.path, f"bytes are not the entry's to_sha256 {p.to_sha256}")
            )
            continue
        try:
            base = apply_patch(data, reverse_patch(patch_path.read_text(encoding="utf-8")), p.path)
        except MismatchError as exc:
            out.append(problem("pending", p.path, f"patch no longer reproduces: {exc}"))
            continue
        if _sha256(base) != p.from_sha256:
            out.append(
                problem(
                    "pending",
                    p.path,
                    f"patch no longer reproduces: reversed it gives sha256 {_sha256(base)}, "
                    f"entry says from_sha256 {p.from_sha256}",
                )
            )
    return out


def _planted_upstream(drop_dir: Path) -> list[dict[str, str]]:
    # Only a built wheel carries <package>/_upstream/ (hatch_build.py); in a checkout one is
    # planted or stale, and a shim must never be offered it.
    return [
        problem(
            "planted",
            p.relative_to(drop_dir).as_posix(),
            "only a built wheel carries _upstream/; the checkout's tree is src/. Remove it",
        )
        for p in sorted(drop_dir.glob("shim/*/_upstream"))
    ]


def verify(root: Path, name: str) -> dict[str, Any]:
    """Offline check of one drop: front matter, lock vs src/ bytes and modes, pin, pending,
    license files, no `_upstream/` in the shim. A malformed VENDOR.md is a failed check here
    (exit 1), not a usage error."""
    if name not in drop_names(root):
        load_drop(root, name)  # raises UsageError naming the known drops
    try:
        drop = load_drop(root, name)
    except UsageError as exc:
        return {
            "name": name,
            "ok": False,
            "materialized": (root / "vendor" / name / "src").is_dir(),
            "files": 0,
            "tree_sha256": None,
            "problems": [problem("front-matter", META_NAME, str(exc))],
        }
    problems = _planted_upstream(drop.dir)
    materialized = drop.src.is_dir()
    try:
        lock: Lock | None = load_lock(drop.lock_path)
    except UsageError as exc:
        lock = None
        problems.append(problem("lock", drop.lock_path.name, str(exc)))
    if lock is not None:
        if lock.drop != name:
            problems.append(problem("lock", drop.lock_path.name, f"lock is for drop {lock.drop!r}"))
        if lock.pin != drop.meta.source.identity():
            problems.append(
                problem(
                    "pin",
                    META_NAME,
                    f"VENDOR.md pins {drop.meta.source.identity()} but the lock was made from "
                    f"{lock.pin}; run `uv run tools/vendor.py sync {name} --to <rev>`",
                )
            )
        if tree_digest(lock.files) != lock.tree_sha256:
            problems.append(
                problem("lock", drop.lock_path.name, "tree_sha256 does not match its files")
            )
        want_pending = {p.path: p.to_sha256 for p in drop.meta.pending}
        if lock.pending != want_pending:
            problems.append(
                problem(
                    "pending",
                    drop.lock_path.name,
                    f"lock pending {lock.pending} != VENDOR.md {want_pending}",
                )
            )
        for lic in drop.meta.license.files:
            if lic not in lock.files:
                problems.append(
                    problem("license", lic, "license file listed in VENDOR.md is not in the drop")
                )
        if materialized:
            problems += check_tree(drop, lock)
    if not materialized:
        problems.append(
            problem(
                "materialized",
                "src/",
                f"not materialized; run `uv run tools/vendor.py sync {name}`",
            )
        )
    else:
        problems += _check_pending(drop)
    return {
        "name": name,
        "ok": not problems,
        "materialized": materialized,
        "files": len(lock.files) if lock else 0,
        "tree_sha256": lock.tree_sha256 if lock else None,
        "problems": problems,
    }


def status(root: Path) -> list[dict[str, Any]]:
    """One row per drop: pin, sync date and age, pending count, materialized, verified."""
    rows: list[dict[str, Any]] = []
    now = _dt.date.fromisoformat(today())
    for name in drop_names(root):
        try:
            drop = load_drop(root, name)
        except UsageError as exc:
            rows.append(
                {
                    "name": name,
                    "materialized": False,
                    "verified": False,
                    "pending": 0,
                    "error": str(exc),
                }
            )
            continue
        v = verify(root, name)
        try:
            age: int | None = (now - _dt.date.fromisoformat(drop.meta.sync_date)).days
        except ValueError:
            age = None
        rows.append(
            {
                "name": name,
                "kind": drop.meta.source.kind,
                "pin": drop.meta.source.revision,
                "sync_date": drop.meta.sync_date,
                "age_days": age,
                "pending": len(drop.meta.pending),
                "materialized": v["materialized"],
                "verified": v["ok"],
                "problems": len(v["problems"]),
            }
        )
    return rows


def _tracked(root: Path, rel: str) -> list[str]:
    try:
        proc = subprocess.run(
            ["git", "ls-files", "--", rel], cwd=root, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return proc.stdout.split() if proc.returncode == 0 else []


def _generated(d: Path, pkg: str, meta: DropMeta) -> list[dict[str, str]]:
    """The build hook and shim files that differ from what `templates` generates."""
    try:
        lock_paths: list[str] = list(load_lock(d / LOCK_NAME).files)
    except UsageError as exc:
        return [problem("lock", LOCK_NAME, str(exc))]
    want = {"hatch_build.py": HATCH_BUILD} | {
        f"{pkg}/{rel}": text
        for rel, text in shim_files(
            meta.name, Path(pkg).name, meta.description, is_python_tree(lock_paths)
        ).items()
    }
    out: list[dict[str, str]] = []
    for rel, text in want.items():
        path = d / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(
                problem(
                    "generated",
                    rel,
                    "differs from what tools/vendorlib/templates.py generates for this drop "
                    "(every drop's build hook and shim come from there; regenerate, do not edit)",
                )
            )
    return out


def lint(root: Path, name: str) -> dict[str, Any]:
    """Static checks of a drop's metadata and member layout (offline)."""
    problems: list[dict[str, str]] = []
    d = root / "vendor" / name
    try:
        drop = load_drop(root, name)
    except UsageError as exc:
        return {
            "name": name,
            "ok": False,
            "problems": [problem("front-matter", META_NAME, str(exc))],
        }
    m = drop.meta
    if m.name != name:
        problems.append(
            problem(
                "front-matter", META_NAME, f"name {m.name!r} is not the directory name {name!r}"
            )
        )
    for key, value in (
        ("description", m.description),
        ("sync.date", m.sync_date),
        ("sync.update", m.update),
    ):
        if not value.strip():
            problems.append(problem("front-matter", META_NAME, f"{key} is empty"))
    if not m.consumers:
        problems.append(
            problem("front-matter", META_NAME, "consumers is empty: name the kernels using it")
        )
    if not m.origin.repo.strip() or not m.origin.commit.strip():
        problems.append(
            problem("front-matter", META_NAME, f"origin repo/commit empty (say {NOT_RECORDED!r})")
        )
    if "\n+++" in m.body:
        problems.append(problem("front-matter", META_NAME, "prose holds a second `+++` line"))
    pyproject = d / "pyproject.toml"
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))
        dist = project["project"]["name"]
        packages = project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as exc:
        problems.append(problem("member", "pyproject.toml", f"unreadable or incomplete: {exc!r}"))
    else:
        if not dist.startswith("moe-ep-drop-"):
            problems.append(
                problem(
                    "member",
                    "pyproject.toml",
                    f"distribution {dist!r} must start with 'moe-ep-drop-'",
                )
            )
        for pkg in packages:
            if not pkg.startswith("shim/") or not (d / pkg / "__init__.py").is_file():
                problems.append(
                    problem("member", "pyproject.toml", f"package {pkg!r} is not a shim/ package")
                )
            else:
                problems += _generated(d, pkg, m)
    if (
        "/src/" not in (d / ".gitignore").read_text(encoding="utf-8")
        if (d / ".gitignore").is_file()
        else True
    ):
        problems.append(problem("member", ".gitignore", "must ignore /src/"))
    referenced = {p.patch for p in m.pending}
    for p in m.pending:
        if not (d / p.patch).is_file():
            problems.append(problem("pending", p.patch, f"patch of pending {p.path} is missing"))
    if (d / "patches").is_dir():
        for f in sorted((d / "patches").iterdir()):
            if f"patches/{f.name}" not in referenced:
                problems.append(
                    problem("pending", f"patches/{f.name}", "no [[pending]] entry uses this patch")
                )
    tracked = _tracked(root, f"vendor/{name}/src")
    if tracked:
        problems.append(
            problem("committed", tracked[0], f"{len(tracked)} upstream files are tracked by git")
        )
    return {"name": name, "ok": not problems, "problems": problems}


_SPDX = re.compile(r"SPDX-License-Identifier:\s*(.+)")
_SPDX_TOKEN = re.compile(r"[A-Za-z0-9.+-]+")


def _spdx_ids(expression: str) -> set[str]:
    return {t for t in _SPDX_TOKEN.findall(expression) if t not in {"AND", "OR", "WITH"}}


def licenses(root: Path, name: str) -> dict[str, Any]:
    """Declared license vs what the files say: license files present, SPDX headers found."""
    drop = load_drop(root, name)
    lic = drop.meta.license
    declared = _spdx_ids(lic.spdx)
    problems: list[dict[str, str]] = []
    files = [{"path": f, "present": (drop.src / f).is_file()} for f in lic.files]
    for f in files:
        if not f["present"]:
            problems.append(
                problem("license", str(f["path"]), "listed license file is missing from src/")
            )
    headers: dict[str, int] = {}
    without: list[str] = []
    if drop.src.is_dir():
        entries, _ = scan_dir(drop.src)
        for rel in entries:
            head = (drop.src / rel).read_bytes()[:8192].decode("utf-8", errors="replace")
            found = [
                m.group(1).strip().removesuffix("*/").removesuffix("-->").strip()
                for m in _SPDX.finditer(head)
            ]
            if not found:
                without.append(rel)
            for expr in found:
                headers[expr] = headers.get(expr, 0) + 1
                undeclared = _spdx_ids(expr) - declared
                if undeclared:
                    problems.append(
                        problem(
                            "license",
                            rel,
                            f"header says {expr!r}, not covered by declared {lic.spdx!r}",
                        )
                    )
    else:
        problems.append(
            problem(
                "materialized",
                "src/",
                f"not materialized; run `uv run tools/vendor.py sync {name}`",
            )
        )
    return {
        "name": name,
        "spdx": lic.spdx,
        "license_files": files,
        "note": lic.note,
        "headers": dict(sorted(headers.items())),
        "without_header": without,
        "ok": not problems,
        "problems": problems,
    }

"""VENDOR.md: a TOML front matter block between `+++` lines, then free prose.

The front matter is machine-read and rewritten by the tool (`add`, `sync --to`, `pull-file`);
comments inside it are not kept. The prose after the block is never touched.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vendorlib.errors import UsageError
from vendorlib.paths import relative_path

__all__ = [
    "DEFAULT_INDEX",
    "META_NAME",
    "NOT_RECORDED",
    "PATCH_DIR",
    "SCHEMA",
    "DropMeta",
    "License",
    "Origin",
    "Pending",
    "Pin",
    "load_meta",
    "parse_meta",
    "render_meta",
    "write_meta",
]

META_NAME = "VENDOR.md"
PATCH_DIR = "patches"
SCHEMA = 1
NOT_RECORDED = "not recorded"
DEFAULT_INDEX = "https://pypi.org/simple"
_SHA1 = re.compile(r"[0-9a-f]{40}\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")

_REV_KEY = {"git": "commit", "pypi": "version", "path": "path"}
_PIN_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # kind: (required keys, optional keys)
    "git": (("url", "commit", "subdir"), ("ref",)),
    "pypi": (("distribution", "version", "artifact", "sha256", "subdir"), ("index",)),
    "path": (("path", "subdir"), ()),
}


@dataclass(frozen=True)
class Pin:
    """Where the bytes come from. `fields` holds the kind's keys (see docs/vendoring.md)."""

    kind: str
    fields: dict[str, str]

    @property
    def subdir(self) -> str:
        return self.fields.get("subdir", "").strip("/")

    @property
    def revision(self) -> str:
        """The pinned revision: git commit, PyPI version, or the local path."""
        return self.fields[_REV_KEY[self.kind]]

    def identity(self) -> dict[str, str]:
        """The keys that define the bytes (fetch locations such as `index` left out)."""
        keep = {k: v for k, v in self.fields.items() if k not in {"index", "ref"}}
        return {"kind": self.kind, **keep}

    def with_fields(self, **changes: str) -> Pin:
        return replace(self, fields={**self.fields, **changes})


@dataclass(frozen=True)
class Origin:
    """The original upstream as the source's own provenance records it."""

    repo: str = NOT_RECORDED
    commit: str = NOT_RECORDED
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class License:
    """SPDX expression, license files (relative to src/) that must exist, and a note."""

    spdx: str
    files: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Pending:
    """One file taken from a newer upstream revision ahead of the pin."""

    path: str
    from_rev: str
    to_rev: str
    from_sha256: str
    to_sha256: str
    patch: str
    reason: str
    date: str


@dataclass(frozen=True)
class DropMeta:
    """The parsed front matter of one drop plus its prose body."""

    name: str
    description: str
    origin: Origin
    source: Pin
    license: License
    include: tuple[str, ...] = ("**",)
    exclude: tuple[str, ...] = ()
    sync_date: str = ""
    update: str = ""
    consumers: tuple[str, ...] = ()
    pending: tuple[Pending, ...] = ()
    body: str = ""


def _need(table: dict[str, Any], key: str, where: str, kind: type = str) -> Any:
    if key not in table:
        raise UsageError(f"{where}: missing key {key!r}")
    value = table[key]
    if not isinstance(value, kind):
        raise UsageError(
            f"{where}: key {key!r} must be a {kind.__name__}, got {type(value).__name__} {value!r}"
        )
    return value


def _str_list(
    table: dict[str, Any], key: str, where: str, default: tuple[str, ...]
) -> tuple[str, ...]:
    value = table.get(key, list(default))
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{where}: key {key!r} must be a list of strings, got {value!r}")
    return tuple(value)


def parse_meta(text: str, where: str = META_NAME) -> DropMeta:
    """Parse a VENDOR.md; every problem raises `UsageError` naming the table and key."""
    lines = text.split("\n")
    if not lines or lines[0].strip() != "+++":
        raise UsageError(f"{where}: must start with a `+++` line opening the TOML front matter")
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "+++")
    except StopIteration:
        raise UsageError(f"{where}: front matter is not closed by a `+++` line") from None
    try:
        doc = tomllib.loads("\n".join(lines[1:end]))
    except tomllib.TOMLDecodeError as exc:
        # tomllib counts lines from the block start; the file has one `+++` line before it.
        raise UsageError(
            f"{where}: front matter is not valid TOML ({exc}; add 1 to the line)"
        ) from None
    body = "\n".join(lines[end + 1 :])

    schema = _need(doc, "schema", where, int)
    if schema != SCHEMA:
        raise UsageError(f"{where}: schema = {schema} unsupported (expected {SCHEMA})")
    name = _need(doc, "name", where)
    if not _NAME.match(name):
        raise UsageError(f"{where}: name {name!r} must be lower_snake_case, e.g. 'sm90_push_cuda'")
    description = _need(doc, "description", where)

    o = _need(doc, "origin", where, dict)
    origin = Origin(
        repo=_need(o, "repo", f"{where} [origin]"),
        commit=_need(o, "commit", f"{where} [origin]"),
        notes=str(o.get("notes", "")),
        extra={k: v for k, v in o.items() if k not in {"repo", "commit", "notes"}},
    )

    s = _need(doc, "source", where, dict)
    kind = _need(s, "kind", f"{where} [source]")
    if kind not in _PIN_KEYS:
        raise UsageError(f"{where} [source]: kind {kind!r} is not one of {sorted(_PIN_KEYS)}")
    required, optional = _PIN_KEYS[kind]
    fields = {k: _need(s, k, f"{where} [source]") for k in required}
    for k in optional:
        if k in s:
            fields[k] = _need(s, k, f"{where} [source]")
    unknown = set(s) - {"kind", *required, *optional}
    if unknown:
        raise UsageError(f"{where} [source]: unknown keys {sorted(unknown)} for kind {kind!r}")
    if kind == "git" and not _SHA1.match(fields["commit"]):
        raise UsageError(
            f"{where} [source]: commit must be a full 40-hex sha1, got {fields['commit']!r}"
        )
    if kind == "pypi" and not _SHA256.match(fields["sha256"]):
        raise UsageError(
            f"{where} [source]: sha256 must be 64 lower-case hex, got {fields['sha256']!r}"
        )
    source = Pin(kind, fields)

    f = doc.get("files", {})
    include = _str_list(f, "include", f"{where} [files]", ("**",))
    exclude = _str_list(f, "exclude", f"{where} [files]", ())

    lic = _need(doc, "license", where, dict)
    license_ = License(
        spdx=_need(lic, "spdx", f"{where} [license]"),
        files=_str_list(lic, "files", f"{where} [license]", ()),
        note=str(lic.get("note", "")),
    )
    if not license_.files and not license_.note.strip():
        raise UsageError(
            f"{where} [license]: files is empty, so note must say where the license terms are"
        )

    sync = doc.get("sync", {})
    consumers = _str_list(doc, "consumers", where, ())
    pending = []
    for i, p in enumerate(doc.get("pending", [])):
        w = f"{where} [[pending]] #{i + 1}"
        # Both paths are read, written and deleted by the tool: they must stay in the drop.
        path = relative_path(_need(p, "path", w), f"{w} path", "common/utils.py")
        patch = relative_path(_need(p, "patch", w), f"{w} patch", PATCH_DIR + "/x.patch")
        if not patch.startswith(PATCH_DIR + "/"):
            raise UsageError(
                f"{w} patch {patch!r} is refused: patches live under {PATCH_DIR}/, "
                f"e.g. {PATCH_DIR + '/common__utils.py.patch'!r}"
            )
        pending.append(
            Pending(
                path=path,
                from_rev=_need(p, "from_rev", w),
                to_rev=_need(p, "to_rev", w),
                from_sha256=_need(p, "from_sha256", w),
                to_sha256=_need(p, "to_sha256", w),
                patch=patch,
                reason=_need(p, "reason", w),
                date=str(p.get("date", "")),
            )
        )
    return DropMeta(
        name=name,
        description=description,
        origin=origin,
        source=source,
        license=license_,
        include=include,
        exclude=exclude,
        sync_date=str(sync.get("date", "")),
        update=str(sync.get("update", "")),
        consumers=consumers,
        pending=tuple(pending),
        body=body,
    )


def _q(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        if "\n" in value and "'''" not in value and not re.search(r"[\x00-\x08\x0b-\x1f]", value):
            return "'''\n" + value + ("" if value.endswith("\n") else "\n") + "'''"
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        if not value:
            return "[]"
        if len(value) <= 1 and len(_q(value[0])) < 60:
            return "[" + _q(value[0]) + "]"
        return "[\n" + "".join(f"    {_q(v)},\n" for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _ordered(pin: Pin) -> dict[str, str]:
    required, optional = _PIN_KEYS[pin.kind]
    order = [k for k in (*required[:-1], *optional, required[-1]) if k in pin.fields]
    return {k: pin.fields[k] for k in order}


def _table(name: str, items: dict[str, Any], array: bool = False) -> str:
    head = f"[[{name}]]" if array else f"[{name}]"
    return head + "\n" + "".join(f"{k} = {_q(v)}\n" for k, v in items.items())


def render_meta(meta: DropMeta) -> str:
    """The full VENDOR.md text for `meta` (front matter in a fixed order, then the body)."""
    parts = [
        "".join(
            f"{k} = {_q(v)}\n"
            for k, v in {
                "schema": SCHEMA,
                "name": meta.name,
                "description": meta.description,
                "consumers": list(meta.consumers),
            }.items()
        ),
        _table(
            "origin",
            {"repo": meta.origin.repo, "commit": meta.origin.commit, **meta.origin.extra}
            | ({"notes": meta.origin.notes} if meta.origin.notes else {}),
        ),
        _table("source", {"kind": meta.source.kind, **_ordered(meta.source)}),
        _table("files", {"include": list(meta.include), "exclude": list(meta.exclude)}),
        _table(
            "license",
            {"spdx": meta.license.spdx, "files": list(meta.license.files)}
            | ({"note": meta.license.note} if meta.license.note else {}),
        ),
        _table("sync", {"date": meta.sync_date, "update": meta.update}),
    ]
    for p in meta.pending:
        parts.append(
            _table(
                "pending",
                {
                    "path": p.path,
                    "from_rev": p.from_rev,
                    "to_rev": p.to_rev,
                    "from_sha256": p.from_sha256,
                    "to_sha256": p.to_sha256,
                    "patch": p.patch,
                    "reason": p.reason,
                    "date": p.date,
                },
                array=True,
            )
        )
    head = "+++\n" + "\n".join(parts) + "+++\n"
    body = meta.body.lstrip("\n")
    return head + ("\n" + body if body.strip() else "")


def load_meta(drop_dir: Path) -> DropMeta:
    """Read and parse `<drop_dir>/VENDOR.md`."""
    path = drop_dir / META_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: missing (every drop needs a VENDOR.md)") from None
    return parse_meta(text, where=str(path))


def write_meta(drop_dir: Path, meta: DropMeta) -> None:
    """Rewrite `<drop_dir>/VENDOR.md` from `meta` (the prose body is kept as is)."""
    (drop_dir / META_NAME).write_text(render_meta(meta), encoding="utf-8")

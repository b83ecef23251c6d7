"""Finding drops under `<root>/vendor/` and the paths inside one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vendorlib.errors import UsageError
from vendorlib.lockfile import LOCK_NAME
from vendorlib.meta import META_NAME, DropMeta, load_meta

__all__ = ["Drop", "default_root", "drop_names", "load_drop", "select_drops"]


def default_root() -> Path:
    """The repository holding this tool (tools/vendorlib/ -> repo root)."""
    return Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Drop:
    """One drop directory and its parsed VENDOR.md."""

    name: str
    dir: Path
    meta: DropMeta

    @property
    def src(self) -> Path:
        return self.dir / "src"

    @property
    def lock_path(self) -> Path:
        return self.dir / LOCK_NAME


def drop_names(root: Path) -> list[str]:
    """Names of the directories under `<root>/vendor/` that hold a VENDOR.md."""
    vendor = root / "vendor"
    if not vendor.is_dir():
        return []
    return sorted(p.name for p in vendor.iterdir() if (p / META_NAME).is_file())


def load_drop(root: Path, name: str) -> Drop:
    """Load one drop; an unknown name raises `UsageError` listing the known ones."""
    d = root / "vendor" / name
    if not (d / META_NAME).is_file():
        raise UsageError(
            f"no drop named {name!r} under {root / 'vendor'} (drops: {drop_names(root)})"
        )
    return Drop(name=name, dir=d, meta=load_meta(d))


def select_drops(root: Path, names: list[str], all_: bool) -> list[str]:
    """The drop names a command acts on: the given names, or every drop with `--all`."""
    if all_ and names:
        raise UsageError("give drop names or --all, not both")
    if not all_ and not names:
        raise UsageError("name at least one drop, or pass --all")
    return drop_names(root) if all_ else names

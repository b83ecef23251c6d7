"""A vendored drop, reached only through its package `__init__`: `DropRef` (import it, say
why it cannot be used) and `drop_src_module` (a module of its `src/`, loaded by the drop's
own shim, never from `src/` directly).

A CuTe DSL drop puts its `src/` first on `sys.path` and imports generic top-level names
(`common`, `src`, ...), so only one such drop can be active per process; loading a module
here does that.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from moe_ep.errors import MoeEpUnavailableError

__all__ = ["SHIM_LOADERS", "DropRef", "drop_src_module"]

SHIM_LOADERS = ("import_src_module", "load_module", "import_module", "load")
"""Names under which a drop shim may offer "import this module of my src/"."""


@dataclass(frozen=True)
class DropRef:
    """A vendored drop, used only through its package `__init__`."""

    import_name: str
    dist: str

    def module(self) -> ModuleType:
        """The drop package; `ImportError` if it is not installed."""
        return importlib.import_module(self.import_name)

    def reason(self) -> str:
        """ "" if the drop is installed and its sources are materialized, else why not."""
        try:
            mod = self.module()
        except ImportError as exc:
            return (
                f"drop package {self.dist} (import {self.import_name}) is not installed "
                f"({exc}); run `uv sync`"
            )
        probe = getattr(mod, "availability", None)
        if callable(probe):
            try:
                ok, why = probe()
            except Exception as exc:  # the drop's own probe failing is a reason, not a crash
                return f"drop {self.dist}: availability() raised {type(exc).__name__}: {exc}"
            return "" if ok else f"drop {self.dist}: {why}"
        materialized = getattr(mod, "is_materialized", None)
        if callable(materialized) and not materialized():
            return (
                f"drop {self.dist} is not materialized (its src/ is empty); run "
                f"`uv run tools/vendor.py sync`"
            )
        return ""


def drop_src_module(drop: DropRef, name: str, *, needed_by: str) -> ModuleType:
    """Module `name` of the drop's `src/`, imported by the drop's own shim loader.

    `needed_by` names the caller in the error raised when the shim offers no loader.
    Raises `MoeEpUnavailableError` when the drop is missing or unmaterialized.
    """
    why = drop.reason()
    if why:
        raise MoeEpUnavailableError(why)
    mod = drop.module()
    for loader in SHIM_LOADERS:
        fn = getattr(mod, loader, None)
        if callable(fn):
            loaded = fn(name)
            if not isinstance(loaded, ModuleType):
                raise MoeEpUnavailableError(
                    f"{drop.import_name}.{loader}({name!r}) returned {type(loaded).__name__}, "
                    "not a module"
                )
            return loaded
    raise MoeEpUnavailableError(
        f"drop package {drop.import_name} offers none of {SHIM_LOADERS} to import its src/ "
        f"modules; {needed_by} needs one"
    )

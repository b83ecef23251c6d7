"""Loading a module of a drop's `src/` through the drop's own shim (never its `src/` directly).

A CuTe DSL drop puts its `src/` first on `sys.path` and imports generic top-level names
(`common`, `src`, ...), so only one such drop can be active per process; loading a module
here does that.
"""

from __future__ import annotations

from types import ModuleType

from moe_ep.backends.support.hardware import DropRef
from moe_ep.errors import MoeEpUnavailableError

__all__ = ["SHIM_LOADERS", "drop_src_module"]

SHIM_LOADERS = ("import_src_module", "load_module", "import_module", "load")
"""Names under which a drop shim may offer "import this module of my src/"."""


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

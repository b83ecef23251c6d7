"""The sm100 CuTe DSL drop, reached only through its package `__init__` (never its `src/`).

The drop puts its `src/` first on `sys.path` and imports generic top-level names (`common`,
`src`, ...), so it cannot share a process with the sm90 pull drop.
"""

from __future__ import annotations

from types import ModuleType

from moe_ep.errors import MoeEpUnavailableError
from moe_ep_sm100._hardware import DropRef

__all__ = ["CUTEDSL_DROP", "drop_src_module"]

CUTEDSL_DROP = DropRef(
    import_name="moe_ep_drop_sm100_cutedsl", dist="moe-ep-drop-sm100-cutedsl-megamoe"
)

# Names under which a drop shim may offer "import this module of my src/".
_LOADERS = ("import_src_module", "load_module", "import_module", "load")


def drop_src_module(drop: DropRef, name: str) -> ModuleType:
    """Module `name` of the drop's `src/`, imported by the drop's own shim loader."""
    why = drop.reason()
    if why:
        raise MoeEpUnavailableError(why)
    mod = drop.module()
    for loader in _LOADERS:
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
        f"drop package {drop.import_name} offers none of {_LOADERS} to import its src/ "
        f"modules; moe_ep_sm100.drops needs one"
    )

"""A backend package's module `__getattr__` / `__dir__`: lazy kernel classes and deprecated
config-class aliases, so importing the package stays light."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_package_attrs"]


def lazy_package_attrs(
    package: str,
    public: list[str],
    *,
    deprecated: Mapping[str, type],
    lazy: Mapping[str, str],
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A backend package's module `__getattr__` and `__dir__`.

    `deprecated` maps an old config-class name to its class (returned with a
    `DeprecationWarning` naming the replacement); `lazy` maps a public name to the module
    that defines it (imported on first access, so importing the package stays light).
    """

    def __getattr__(name: str) -> Any:
        canonical = deprecated.get(name)
        if canonical is not None:
            warnings.warn(
                f"{package}.{name} is deprecated; use {package}.{canonical.__name__}",
                DeprecationWarning,
                stacklevel=2,
            )
            return canonical
        module = lazy.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    def __dir__() -> list[str]:
        return sorted(public)

    return __getattr__, __dir__

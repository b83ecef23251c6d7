"""The process-wide kernel registry.

Backends are found through the `moe_ep.backends` entry-point group: the entry's name is the
canonical kernel name and its value the kernel class, decorated with `register_mega_kernel`.
Discovery imports each entry once, on the first lookup or listing; an entry whose import
fails is listed as unavailable with the reason and does not affect the others.
"""

from __future__ import annotations

import importlib.metadata
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError
from moe_ep.registry.taxonomy import KernelName, parse_kernel_name

__all__ = [
    "ENTRY_POINT_GROUP",
    "KernelInfo",
    "Registry",
    "available_kernels",
    "default_registry",
    "get_kernel",
    "register_mega_kernel",
    "resolve_kernel_name",
]

ENTRY_POINT_GROUP = "moe_ep.backends"
K = TypeVar("K", bound=type)


@dataclass(frozen=True)
class KernelInfo:
    """One canonical kernel as listed by `available_kernels()`."""

    name: str
    available: bool
    reason: str
    deprecated_aliases: tuple[str, ...] = ()
    source: str = ""
    """The distribution (or module) that provides it."""
    taxonomy: KernelName | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "reason": self.reason,
            "deprecated_aliases": list(self.deprecated_aliases),
            "source": self.source,
        }


@dataclass
class _Entry:
    name: str
    cls: type | None
    aliases: tuple[str, ...] = ()
    source: str = ""
    broken: str = ""
    """Non-empty when the backend could not be loaded or conflicts with another."""


@dataclass
class Registry:
    """A kernel registry; `entry_points` defaults to the installed `moe_ep.backends` group."""

    entry_points: Iterable[importlib.metadata.EntryPoint] | None = None
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _aliases: dict[str, str] = field(default_factory=dict)
    _discovered: bool = False
    _lock: threading.RLock = field(default_factory=threading.RLock)

    # -- registration -------------------------------------------------------------------
    def register(
        self, name: str, cls: type, *, deprecated_aliases: Iterable[str] = (), source: str = ""
    ) -> None:
        """Register `cls` under the canonical `name` with optional deprecated aliases."""
        parse_kernel_name(name)
        aliases = tuple(deprecated_aliases)
        with self._lock:
            known = self._entries.get(name)
            if known is not None and known.cls is not None and known.cls is not cls:
                raise MoeEpUsageError(
                    f"kernel {name!r} is registered twice: by {_qualname(known.cls)} and by "
                    f"{_qualname(cls)}; each kernel name must belong to one backend"
                )
            for alias in aliases:
                if alias == name or alias in self._entries:
                    raise MoeEpUsageError(
                        f"deprecated alias {alias!r} of {name!r} is itself a canonical name"
                    )
                owner = self._aliases.get(alias)
                if owner is not None and owner != name:
                    raise MoeEpUsageError(
                        f"deprecated alias {alias!r} is claimed by both {owner!r} and {name!r}"
                    )
            self._entries[name] = _Entry(name, cls, aliases, source or cls.__module__)
            for alias in aliases:
                self._aliases[alias] = name

    # -- discovery ----------------------------------------------------------------------
    def discover(self) -> None:
        """Import every entry point of the group once (idempotent)."""
        with self._lock:
            if self._discovered:
                return
            self._discovered = True
            eps = self.entry_points
            if eps is None:
                eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            seen: dict[str, str] = {}
            for ep in eps:
                dist = ep.dist.name if ep.dist is not None else ep.value.split(":")[0]
                if ep.name in seen:
                    reason = (
                        f"kernel name {ep.name!r} is provided by two backends: "
                        f"{seen[ep.name]} and {dist}; uninstall one"
                    )
                    self._entries[ep.name] = _Entry(ep.name, None, source=dist, broken=reason)
                    continue
                seen[ep.name] = dist
                self._load(ep, dist)

    def _load(self, ep: importlib.metadata.EntryPoint, dist: str) -> None:
        try:
            obj = ep.load()
        except Exception as exc:  # any import failure becomes an "unavailable" entry
            reason = f"backend {dist} failed to import {ep.value}: {type(exc).__name__}: {exc}"
            self._entries.setdefault(ep.name, _Entry(ep.name, None, source=dist, broken=reason))
            return
        if getattr(obj, "kernel_name", None) != ep.name:
            reason = (
                f"entry point {ep.name!r} of {dist} points at {ep.value}, which is registered as "
                f"{getattr(obj, 'kernel_name', None)!r}; the names must match"
            )
            self._entries[ep.name] = _Entry(ep.name, None, source=dist, broken=reason)
            return
        if ep.name not in self._entries:  # a class imported outside this registry's decorator
            self.register(
                ep.name, obj, deprecated_aliases=getattr(obj, "deprecated_aliases", ()), source=dist
            )
        else:
            self._entries[ep.name].source = dist

    # -- lookup -------------------------------------------------------------------------
    def resolve(self, name: str) -> str:
        """Canonical name of `name`; warns (`DeprecationWarning`) when it is an alias."""
        if not isinstance(name, str):
            raise MoeEpUsageError(
                f"kernel name must be a str, got {type(name).__name__} ({name!r})"
            )
        self.discover()
        if name in self._entries:
            return name
        canonical = self._aliases.get(name)
        if canonical is not None:
            warnings.warn(
                f"kernel name {name!r} is deprecated; use {canonical!r}",
                DeprecationWarning,
                stacklevel=3,
            )
            return canonical
        known = ", ".join(sorted(self._entries)) or "(none installed)"
        raise KeyError(f"unknown kernel {name!r}; known kernels: {known}")

    def get(self, name_or_config: Any) -> type:
        """The kernel class for a name, an alias or a config object with `kernel_name`."""
        name = name_or_config
        if not isinstance(name_or_config, str):
            name = getattr(name_or_config, "kernel_name", None)
            if not isinstance(name, str):
                raise MoeEpUsageError(
                    f"backend must be a kernel name or a kernel config with a `kernel_name`, "
                    f"got {type(name_or_config).__name__}"
                )
        canonical = self.resolve(name)
        entry = self._entries[canonical]
        if entry.cls is None:
            raise MoeEpUnavailableError(f"kernel {canonical!r} is unavailable: {entry.broken}")
        return entry.cls

    def infos(self) -> list[KernelInfo]:
        """Every canonical kernel with its availability on this machine, sorted by name."""
        self.discover()
        out = []
        for name in sorted(self._entries):
            entry = self._entries[name]
            if entry.cls is None:
                ok, reason = False, entry.broken
            else:
                ok, reason = _availability(entry.cls)
            out.append(
                KernelInfo(
                    name=name,
                    available=ok,
                    reason=reason,
                    deprecated_aliases=entry.aliases,
                    source=entry.source,
                    taxonomy=parse_kernel_name(name),
                )
            )
        return out


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _availability(cls: type) -> tuple[bool, str]:
    probe = getattr(cls, "availability", None)
    if probe is None:
        return True, ""
    try:
        ok, reason = probe()
    except Exception as exc:
        return False, f"availability check raised {type(exc).__name__}: {exc}"
    return bool(ok), "" if ok else str(reason)


default_registry = Registry()


def register_mega_kernel(name: str, *, deprecated_aliases: Iterable[str] = ()) -> Callable[[K], K]:
    """Class decorator: register a kernel class under the canonical taxonomy `name`.

    `deprecated_aliases` resolve to `name` with a `DeprecationWarning` and are never listed.
    Sets `kernel_name` and `deprecated_aliases` on the class.
    """
    parse_kernel_name(name)
    aliases = tuple(deprecated_aliases)

    def decorate(cls: K) -> K:
        cls.kernel_name = name  # type: ignore[attr-defined]
        cls.deprecated_aliases = aliases  # type: ignore[attr-defined]
        default_registry.register(name, cls, deprecated_aliases=aliases)
        return cls

    return decorate


def resolve_kernel_name(name: str) -> str:
    """Canonical kernel name for `name`; a deprecated alias warns and names the replacement."""
    return default_registry.resolve(name)


def get_kernel(name_or_config: Any) -> type:
    """Kernel class for a name, alias or config; `KeyError` listing known names if unknown."""
    return default_registry.get(name_or_config)


def available_kernels() -> list[KernelInfo]:
    """Canonical kernels (aliases hidden) with `available` and `reason` for this machine."""
    return default_registry.infos()

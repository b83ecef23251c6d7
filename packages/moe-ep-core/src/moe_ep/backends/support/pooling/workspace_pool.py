"""Process-wide pool of compiled kernels + workspaces, shared by layers of one geometry.

Layers of a model usually share (config, geometry, device); they run one after another on
one stream, so they can share one compiled kernel and one set of workspaces. Each layer
takes a reference on `acquire` and drops it on `release`; the last release frees the entry
(through the entry's `free`, collective for symmetric memory). Each backend module keeps
its own pool instance.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["WorkspacePool"]

T = TypeVar("T")


@dataclass
class _Slot(Generic[T]):
    value: T
    refs: int = 0


@dataclass
class WorkspacePool(Generic[T]):
    """Ref-counted `key -> value`; `free(value)` runs when the last reference goes."""

    free: Callable[[T], Any]
    _slots: dict[Hashable, _Slot[T]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def acquire(self, key: Hashable, create: Callable[[], T]) -> T:
        """The entry for `key`, created with `create()` on first use; takes one reference."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = _Slot(create())
                self._slots[key] = slot
            slot.refs += 1
            return slot.value

    def release(self, key: Hashable) -> bool:
        """Drop one reference; frees and returns True when it was the last one."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                return False
            slot.refs -= 1
            if slot.refs > 0:
                return False
            del self._slots[key]
        self.free(slot.value)
        return True

    def refs(self, key: Hashable) -> int:
        """Current reference count of `key` (0 if absent)."""
        with self._lock:
            slot = self._slots.get(key)
            return 0 if slot is None else slot.refs

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

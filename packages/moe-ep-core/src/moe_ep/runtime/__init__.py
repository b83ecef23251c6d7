"""Runtime bootstrap: bind the device, join (or create) the EP process group, NVSHMEM.

`acquire(config)` returns a `Runtime` handle; the state underneath is process-wide and
ref-counted. The last `Runtime.release()` tears down only what moe-ep created
(barrier -> destroy -> barrier); every wait is bounded by the config's timeout, and a dead
peer is an error naming the rank, never a hang. See docs/runtime.md.

This package imports no backend and no drop (a test reads its imports).
"""

from moe_ep.runtime.core import Runtime, acquire, active_refcount

__all__ = ["Runtime", "acquire", "active_refcount"]

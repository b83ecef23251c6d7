"""Runtime bootstrap: bind the device, join (or create) the EP process group, NVSHMEM.

`acquire(config)` returns a `Runtime` handle; the state underneath is process-wide and
ref-counted. The last `Runtime.release()` tears down only what moe-ep created
(barrier -> destroy -> barrier); every wait and every store call is bounded by the config's
timeout, and a failed peer is one verdict, agreed through the store, naming the rank(s),
never a hang. See docs/runtime.md.

This package imports no backend and no drop (a test reads its imports).
"""

from moe_ep.runtime.core import (
    Runtime,
    acquire,
    active_refcount,
    bounded_wait,
    report_local_failure,
)

__all__ = ["Runtime", "acquire", "active_refcount", "bounded_wait", "report_local_failure"]

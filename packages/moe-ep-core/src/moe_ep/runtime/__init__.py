"""Runtime bootstrap: bind the device, join (or create) the EP process group, NVSHMEM.

`acquire(config)` returns a `Runtime` handle; the state underneath is process-wide and
ref-counted. The last `Runtime.release()` tears down only what moe-ep created
(barrier -> destroy -> barrier); every wait and every store call is bounded by the config's
timeout, and a failed peer is one verdict, agreed through the store, naming the rank(s),
never a hang. See docs/runtime.md.

Modules: `state` (the process-wide state and its barriers), `handle` (`Runtime`),
`bootstrap` (`acquire`), `teardown`; below them `store`, `faults`, `keys`, `bounded`,
`waits`, `gather`, `nvshmem_init`. This package imports no backend and no drop (a test
reads its imports).
"""

from moe_ep.runtime.bootstrap import acquire
from moe_ep.runtime.handle import Runtime
from moe_ep.runtime.state import (
    active_refcount,
    bounded_wait,
    post_and_wait,
    report_local_failure,
)

__all__ = [
    "Runtime",
    "acquire",
    "active_refcount",
    "bounded_wait",
    "post_and_wait",
    "report_local_failure",
]

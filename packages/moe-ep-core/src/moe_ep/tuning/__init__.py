"""The tuning cache: knobs `moe-ep tune` measured best, read by the layer at construction.

- `knobs`: which config fields each kernel's tuner may set, and their candidate values;
- `cache`: the cache file (key, entries, partial sweeps), atomic replace, reported and
  ignored when corrupted or stale;
- `lookup`: `tuned_config`, the layer's lookup at construction.

Imports no torch.distributed and, at import time, no backend (the portable grid and a CPU
key read the portable backend's usable CPUs and fused-library state when called); the
sweep itself is `moe_ep.tune`.
"""

from moe_ep.tuning.cache import TuningCache, TuningKey, cache_path, tokens_bucket
from moe_ep.tuning.lookup import tuned_config

__all__ = ["TuningCache", "TuningKey", "cache_path", "tokens_bucket", "tuned_config"]

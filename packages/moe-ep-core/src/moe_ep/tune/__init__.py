"""`moe-ep tune`: per-kernel tuners over one collective sweep machinery.

- `sweep`: the shared machinery (`Sweep`): the live-token bucket agreed by a max over
  ranks, the knob grid, a timed, resumable sweep whose every candidate's time is the
  slowest rank's (so every rank picks the same winner), the winner written to the cache;
- `tuners`: the kernels' measurement (the layer built on each candidate config, inputs
  restaged for each routing, median of timed forwards after warm-up) and the rank entry
  point `tune_rank` (process-group lifecycle).

The cache and the knobs each kernel declares are `moe_ep.tuning`; layers built from a
kernel name read the cache at construction.
"""

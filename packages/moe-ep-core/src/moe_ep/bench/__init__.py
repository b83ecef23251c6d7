"""`moe-ep bench`: one way to measure the layer against the machine's limits and peers.

Modules (each one subject):
- `shapes`: the default / quick shape families and `--shape` parsing;
- `harness`: one rank's measurements (`bench_rank`), spawned per world size;
- `runner`: the request, its checks (before any rank starts) and the world-size loop;
- `results`: rows merged over ranks, their figures and ratios, the JSON document;
- `report`: the terminal table and the PNG plots;
- `limits`: read bandwidth, dense GEMMs of equal FLOPs, the naive loop, a bare all_to_all;
- `hf_peer`: transformers' experts block as the CPU peer (optional `bench` group);
- `timing`: medians of round-robin runs after warm-up (CUDA events on a GPU: never run on
  one yet);
- `machine`, `targets`, `tables`, `progress`, `plots`: the description of the machine, the
  runbook's targets and the status column, titled tables, progress lines or bar, plot
  styling; shared with the scripts in `benchmarks/`.

Nothing here is imported by the layer or the runtime; `plots` needs matplotlib (dev group).
"""

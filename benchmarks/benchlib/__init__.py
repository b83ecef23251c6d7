"""Helpers of the benchmark scripts in `benchmarks/` that `moe_ep.bench` does not hold (the
machine description, targets, progress, tables, plots, timing and limits live there: one
copy of each, shared with `moe-ep bench`).

- `options`: argparse value types with messages naming the option and the rule;
- `baseline_kernel`: the fused CPU library built from another `cpu_fused.c`;
- `moe_peers`: `layer_speed.py --sections peers crossover` (issue 16).

The scripts run as `python benchmarks/<name>.py`, which puts this folder's parent on
`sys.path`; nothing here is installed.
"""

from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "out"
"""Where the scripts write their plots by default (`benchmarks/out/`, git-ignored)."""

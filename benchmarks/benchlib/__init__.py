"""Helpers shared by the benchmark scripts in `benchmarks/`: one copy of each.

- `machine`: the description of this machine that titles every table and plot;
- `targets`: targets as the runbook states them and the status column (ok / over target /
  under target / n/a);
- `progress`: numbered progress, a bar on a terminal and plain lines otherwise;
- `plots`: figure styling, ratio bars with labelled target lines, legends off the data;
- `options`: argparse value types with messages naming the option and the rule;
- `bandwidth`: the machine's streaming read bandwidth;
- `hf_moe`: transformers' MoE experts block as a peer (optional `bench` group);
- `moe_peers`: `layer_speed.py --sections peers crossover` (issue 16).

The scripts run as `python benchmarks/<name>.py`, which puts this folder's parent on
`sys.path`; nothing here is installed.
"""

from pathlib import Path

OUT_DIR = Path(__file__).resolve().parents[1] / "out"
"""Where the scripts write their plots by default (`benchmarks/out/`, git-ignored)."""

"""Under a real `torchrun` (slow: every rank imports torch from scratch).

Run with: uv run pytest tests/runtime/test_runtime_torchrun.py -m slow
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from moe_ep.spawn import free_port

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
from moe_ep import BootstrapConfig
from moe_ep.runtime import acquire

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
out = {"rank": rank, "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"), "sums": []}
for _ in range(3):  # repeated lifetimes on the agent's long-lived store
    with acquire(BootstrapConfig(world, rank, timeout_s=30)) as rt:
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t, group=rt.group)
        rt.barrier()
        out["sums"].append(t.item())
    out["initialised_after"] = dist.is_initialized()
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
    json.dump(out, f)
"""


def test_bootstrap_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in range(2):
        out = json.loads((tmp_path / f"{rank}.json").read_text())
        assert out["rank"] == rank and out["sums"] == [3.0, 3.0, 3.0]
        assert out["initialised_after"] is False
        assert out["agent_store"] == "True"  # the path where torchrun's agent hosts the store

"""Two torchrun agents (`--nnodes 2`, c10d rendezvous on loopback, 2 workers each) run the
layer in replicate mode; one worker is killed and the survivors go on with the same bits.

When a worker dies its agent stops its other worker and leaves; the survivors' agent then
waits out torchelastic's exit barrier (300 s, no torchrun flag shortens it), so the test
reads the survivors' results and stops the agents itself.

Losing global rank 0's worker takes its agent with it, and that agent (group rank 0)
serves the workers' store (TORCHELASTIC_USE_AGENT_STORE), and here the rendezvous store
too: so for that case this test serves one store (`serve_store`), the agents rendezvous
through it (`--rdzv-conf=is_host=false`) and the workers join it with
`external_store=True`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from moe_ep.runtime.store_server import serve_store
from moe_ep.spawn import free_port

pytestmark = [pytest.mark.slow, pytest.mark.multirank]

WORKER = Path(__file__).with_name("evict_torchrun_worker.py")


def _agent(
    port: int, out: Path, log: Path, kill: int, store: str | None
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=evict",
           "--max-restarts=0"]  # fmt: skip
    if store is not None:  # the test serves the rendezvous store: no agent hosts it
        cmd.append("--rdzv-conf=is_host=false")
    cmd += [str(WORKER), str(out), str(kill)] + ([store] if store else [])
    with log.open("wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _run_agents(tmp_path: Path, kill: int, survivors: list[int], store: Any) -> float:
    """Both agents, until the survivors wrote their results; the seconds that took."""
    port = free_port() if store is None else store.port
    start = time.monotonic()
    addr = None if store is None else store.init_method
    # without a store of the test's, the first agent hosts the rendezvous store: started first
    agents = [_agent(port, tmp_path, tmp_path / "a.log", kill, addr)]
    time.sleep(1.5)
    agents.append(_agent(port, tmp_path, tmp_path / "b.log", kill, addr))
    try:
        want = [tmp_path / f"{r}.json" for r in survivors]
        while not all(p.exists() for p in want) and time.monotonic() - start < 150:
            time.sleep(0.2)
        elapsed = time.monotonic() - start
        logs = "".join(p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("*.log"))
        assert all(p.exists() for p in want), logs
    finally:
        for agent in agents:  # the agents started here, by process group id
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGTERM)
        for agent in agents:
            try:
                agent.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    return elapsed


def test_torchrun_two_agents_survivors_continue_in_replicate_mode(tmp_path: Path) -> None:
    elapsed = _run_agents(tmp_path, 3, [0, 1], None)
    for rank in (0, 1):
        out = json.loads((tmp_path / f"{rank}.json").read_text())
        assert out["verdicts"][0] in ([3], [2, 3]), out
        assert out["survivors"] == [0, 1] and out["world_after"] == 2, out
        assert out["same_bits"] is True, out
    assert not (tmp_path / "2.json").exists() and not (tmp_path / "3.json").exists()
    print(f"survivors served again {elapsed:.1f} s after the agents started")


def test_torchrun_losing_global_rank_0_with_the_test_serving_the_store(tmp_path: Path) -> None:
    with serve_store("127.0.0.1") as store:
        elapsed = _run_agents(tmp_path, 0, [2, 3], store)
    for rank in (2, 3):
        out = json.loads((tmp_path / f"{rank}.json").read_text())
        assert out["verdicts"][0] in ([0], [0, 1]), out
        assert out["survivors"] == [2, 3] and out["world_after"] == 2, out
        assert out["same_bits"] is True, out
    assert not (tmp_path / "0.json").exists() and not (tmp_path / "1.json").exists()
    print(f"survivors served again {elapsed:.1f} s after the agents started")

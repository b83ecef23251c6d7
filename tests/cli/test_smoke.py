"""`moe-ep smoke`: a real run per mode (and one losing rank 0, which the smoke's own store
server makes survivable), counting the survivors' SMOKE_RESULT lines."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.multirank

LINE = re.compile(
    r"^SMOKE_RESULT rank=(\d) verdict=\[(\d)\] matched_oracle=(true|false) mode=(\w+)(.*)$"
)


@pytest.mark.parametrize(("mode", "kill"), [("replicate", 3), ("mask", 1), ("replicate", 0)])
def test_smoke_prints_one_line_per_survivor(mode: str, kill: int) -> None:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "moe_ep.cli", "smoke", "--world-size", "4",
         "--kill-rank", str(kill), "--mode", mode],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert time.monotonic() - start < 60
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [LINE.match(s) for s in done.stdout.splitlines() if s.startswith("SMOKE_RESULT")]
    assert all(lines) and len(lines) == 3, done.stdout
    assert sorted(int(m[1]) for m in lines if m) == [r for r in range(4) if r != kill]
    for m in lines:
        assert m and int(m[2]) == kill and m[3] == "true" and m[4] == mode
        if mode == "replicate":
            assert "same_bits=true" in m[5]
        else:
            assert f"masked_experts=[{2 * kill}, {2 * kill + 1}]" in m[5]


def test_smoke_refuses_a_kill_rank_outside_the_world() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "moe_ep.cli", "smoke", "--kill-rank", "4"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--kill-rank must be in [0, --world-size=4), got 4" in done.stderr

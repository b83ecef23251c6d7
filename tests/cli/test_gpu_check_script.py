"""`benchmarks/gpu_check.sh` cannot be run here (no GPU), and a GPU loan is too short to debug
it there: check its shell syntax and the Python it embeds, on CPU."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"
# `"$PY" - <<'EOF'` (read from stdin) or `cat > "$OUT_DIR/name.py" <<'EOF'` (a file), to EOF
HEREDOC = re.compile(r"^(?P<head>[^\n]*)<<'EOF'[^\n]*\n(?P<body>.*?)^EOF$", re.M | re.S)


def _python_blocks() -> list[tuple[str, str]]:
    return [(m["head"], m["body"]) for m in HEREDOC.finditer(SCRIPT.read_text())]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_shell_syntax() -> None:
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_embedded_python_compiles() -> None:
    blocks = _python_blocks()
    assert len(blocks) >= 5
    for head, body in blocks:
        compile(body, f"gpu_check.sh: {head.strip()}", "exec")


def test_scripts_that_spawn_ranks_run_from_a_file_behind_a_main_guard() -> None:
    """Spawned ranks re-import the parent's main module by path: a script read from stdin has
    none (the rank dies), and top-level work would run again in every rank."""
    spawning = 0
    for head, body in _python_blocks():
        if "spawn_local" not in body and "moe_ep.cli import main" not in body:
            continue
        spawning += 1
        assert head.startswith("cat > "), f"spawns ranks but is read from stdin: {head!r}"
        assert 'if __name__ == "__main__":' in body, head
    assert spawning == 2

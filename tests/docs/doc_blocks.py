"""The Python code blocks of the project's markdown, and how the doc test runs one.

A block is a fenced block whose info string is `python` (or `py`). A comment on the line
before its fence marks a block that cannot run here: `<!-- doc-test: skip REASON -->`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON_INFO = frozenset({"python", "py"})
TIMEOUT_S = 180.0
# A reader's shell has no rendezvous set; the examples must not lean on the test's env.
CLEARED_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "TORCHELASTIC_USE_AGENT_STORE",
)

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")


@dataclass(frozen=True)
class Block:
    """One Python block: where it is, its code, and the skip reason it is marked with."""

    path: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO).as_posix()}:{self.line}"


def markdown_files(root: Path = REPO) -> list[Path]:
    """README.md and docs/*.md of `root`."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _skip_reason(path: Path, lines: list[str], fence_index: int) -> str | None:
    before = fence_index - 1
    while before >= 0 and not lines[before].strip():
        before -= 1
    m = _DIRECTIVE.match(lines[before]) if before >= 0 else None
    if m is None:
        return None
    verb, _, reason = m["body"].strip().partition(" ")
    if verb != "skip" or not reason.strip():
        raise ValueError(
            f"{path}:{before + 1}: doc-test directive must be `<!-- doc-test: skip REASON -->` "
            f"with a reason, got {lines[before].strip()!r}"
        )
    return reason.strip()


def python_blocks(path: Path) -> list[Block]:
    """Every Python block of the markdown file `path`, in order.

    Raises:
        ValueError: a block is never closed, or a doc-test directive is malformed.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, indent = m["fence"], len(m["indent"])
        close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: code block is never closed")
        if m["info"].lower() in PYTHON_INFO:
            body = [ln[indent:] if ln[:indent].isspace() else ln for ln in lines[i + 1 : end]]
            code = "\n".join(body) + "\n"
            blocks.append(Block(path, i + 1, code, _skip_reason(path, lines, i)))
        i = end + 1
    return blocks


def run_block(block: Block, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run the block's code in a fresh interpreter, cwd the repository root."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
    return subprocess.run(
        [sys.executable, "-c", block.code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )

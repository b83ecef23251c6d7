"""Every Python code block of README.md and docs/*.md runs as written.

Each block runs in a fresh interpreter (cwd the repository root, no rendezvous variables) and
must exit 0. A block that cannot run here is marked `<!-- doc-test: skip REASON -->` on the
line before its fence and is skipped with that reason.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from doc_blocks import REPO, Block, markdown_files, python_blocks, run_block

BLOCKS = [b for path in markdown_files() for b in python_blocks(path)]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.name for b in BLOCKS])
def test_doc_block_runs(block: Block) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.name}: {block.skip}")
    proc = run_block(block)
    assert proc.returncode == 0, (
        f"{block.name} exited {proc.returncode}\n--- code\n{block.code}--- stderr\n"
        f"{proc.stderr[-4000:]}"
    )


def test_the_layer_and_runtime_examples_are_found() -> None:
    found = {b.path.relative_to(REPO).as_posix() for b in BLOCKS if b.skip is None}
    assert {"docs/layer.md", "docs/runtime.md"} <= found


def _md(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_extractor_finds_python_blocks_only_with_their_lines_and_marks(tmp_path: Path) -> None:
    path = _md(
        tmp_path,
        "# t\n"
        "```bash\nuv run x\n```\n"
        "```python\nx = 1\n```\n"
        "<!-- doc-test: skip needs a GPU -->\n\n"
        "````py\n```\nprint('fence inside')\n````\n"
        "```\nplain\n```\n"
        "  ```python\n  y = 2\n    z = 3\n  ```\n",
    )
    blocks = python_blocks(path)
    assert [(b.line, b.code, b.skip) for b in blocks] == [
        (5, "x = 1\n", None),
        (10, "```\nprint('fence inside')\n", "needs a GPU"),
        (17, "y = 2\n  z = 3\n", None),
    ]


@pytest.mark.parametrize("directive", ["<!-- doc-test: skip -->", "<!-- doc-test: run fast -->"])
def test_a_malformed_mark_is_an_error(tmp_path: Path, directive: str) -> None:
    path = _md(tmp_path, f"{directive}\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match=r"page\.md:1: doc-test directive must be"):
        python_blocks(path)


def test_an_unclosed_block_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"page\.md:1: code block is never closed"):
        python_blocks(_md(tmp_path, "```python\nx = 1\n"))


def test_a_failing_block_fails_and_the_env_has_no_rendezvous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    path = _md(
        tmp_path,
        "```python\nimport os, pathlib\nassert 'MASTER_ADDR' not in os.environ\n"
        f"assert pathlib.Path.cwd() == pathlib.Path({str(REPO)!r})\n```\n"
        "```python\nraise SystemExit(3)\n```\n",
    )
    ok, bad = python_blocks(path)
    assert run_block(ok, timeout_s=60).returncode == 0
    assert run_block(bad, timeout_s=60).returncode == 3

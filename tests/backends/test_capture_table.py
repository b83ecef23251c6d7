"""docs/backends.md "Graph capture" table against the registered GPU kernels' flags, so the
doc cannot drift: one row per registered GPU kernel (no more), and each row's
`capturable`, `supports_live_tokens`, `supports_unfinalized` equal to the class's."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest

from moe_ep.registry.registry import available_kernels, get_kernel

DOC = Path(__file__).resolve().parents[2] / "docs" / "backends.md"
FLAGS = ("capturable", "supports_live_tokens", "supports_unfinalized")
GPU_PREFIXES = ("sm90_", "sm100_")


def capture_table(text: str) -> dict[str, dict[str, bool]]:
    """{kernel: {flag: value}} from the "Graph capture" section's table."""
    section = text.split("## Graph capture", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    header = next(line for line in section.splitlines() if line.startswith("| kernel |"))
    columns = [c.strip().strip("`") for c in header.strip("|").split("|")]
    table: dict[str, dict[str, bool]] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        name = cells[0].strip("`")
        values = {}
        for flag in FLAGS:
            cell = cells[columns.index(flag)]
            if cell not in ("yes", "no"):
                raise ValueError(f"{name}: {flag} must be yes or no, got {cell!r}")
            values[flag] = cell == "yes"
        assert name not in table, f"{name} has two rows"
        table[name] = values
    return table


def gpu_kernels() -> dict[str, type]:
    return {
        info.name: get_kernel(info.name)
        for info in available_kernels()
        if info.name.startswith(GPU_PREFIXES)
    }


def drift(table: dict[str, dict[str, bool]], kernels: dict[str, type]) -> list[str]:
    """What the table says that the classes do not (empty: they agree)."""
    wrong = [f"rows without a kernel: {sorted(set(table) - set(kernels))}"] * bool(
        set(table) - set(kernels)
    )
    for name, cls in kernels.items():
        actual = {flag: getattr(cls, flag) for flag in FLAGS}
        if table.get(name) != actual:
            wrong.append(f"{name}: table {table.get(name)}, class {actual}")
    return wrong


def test_the_table_has_a_row_per_registered_gpu_kernel_with_its_flags() -> None:
    kernels = gpu_kernels()
    assert len(kernels) == 9, sorted(kernels)  # the nine GPU wrappers of docs/backends.md
    assert drift(capture_table(DOC.read_text(encoding="utf-8")), kernels) == []


def test_no_gpu_wrapper_sets_capturable_per_instance() -> None:
    """`capturable` may be set in `__init__` (the portable kernel does); the table reads the
    class, so a wrapper that set it on its instances would make the table wrong."""
    for name, cls in gpu_kernels().items():
        source = inspect.getsource(sys.modules[cls.__module__])
        assert not re.search(r"\bcapturable\s*=", source), name


def test_a_drifted_row_is_caught() -> None:
    text = DOC.read_text(encoding="utf-8")
    row = "| `sm90_fp8_fp8_bf16_push_cuda` | no |"
    assert row in text
    kernels = gpu_kernels()
    drifted = capture_table(text.replace(row, "| `sm90_fp8_fp8_bf16_push_cuda` | yes |"))
    assert drift(drifted, kernels) != []
    missing = {k: v for k, v in capture_table(text).items() if not k.startswith("sm100_")}
    assert len(drift(missing, kernels)) == 4  # the four sm100 rows removed
    extra = {**capture_table(text), "sm90_gone": dict.fromkeys(FLAGS, False)}
    assert drift(extra, kernels) == ["rows without a kernel: ['sm90_gone']"]
    with pytest.raises(ValueError, match="capturable must be yes or no"):
        capture_table(text.replace(row, "| `sm90_fp8_fp8_bf16_push_cuda` | maybe |"))

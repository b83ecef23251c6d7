"""The benchmark scripts and their shared `benchlib`, importable as the scripts see them
(`python benchmarks/<name>.py` puts `benchmarks/` first on sys.path)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


@pytest.fixture(scope="session")
def load_script() -> Callable[[str], ModuleType]:
    """Import `benchmarks/<name>.py` as a module (its `main` does not run)."""

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load

"""Every benchmark script's `--help` exits 0, describes what it measures and its targets,
and names each option with a help text (tests run no benchmark)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from conftest import BENCHMARKS

# What docs/runbook.md documents for each script: its options and the targets it states.
SCRIPTS: dict[str, tuple[set[str], tuple[str, ...]]] = {
    "layer_speed": (
        {"--reps", "--threads", "--prefill", "--decode", "--stages", "--out", "--no-plot"}
        | {"--sections", "--peer-shapes", "--baseline-kernel", "--cpu-prepacked-weights"},
        ("layer / dense <= 1.3x", "naive / layer > 1x", "target < 2x"),
    ),
    "layer_comm": (
        {"--tokens", "--hidden", "--experts", "--topk", "--reps", "--out", "--no-plot"},
        (">= 80%",),
    ),
    "quant_speed": (
        {"--rows", "--cols", "--repeats", "--out", "--no-plot"},
        ("<= 5x", "<= 8x"),
    ),
    "expert_gemm_speed": (
        {"--experts", "--n", "--k", "--rows", "--threads", "--reps", "--baseline-kernel"}
        | {"--out", "--no-plot"},
        ("<= 2x",),
    ),
    "quant_snr": ({"--rows", "--cols", "--seed", "--out", "--no-plot"}, ("No target",)),
}


def _help(*cmd: str, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=120, cwd=cwd or BENCHMARKS.parent
    )
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())  # argparse wraps lines: compare on words


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_exits_0_and_names_every_option_and_target(name: str) -> None:
    text = _help(sys.executable, str(BENCHMARKS / f"{name}.py"), "--help")
    options, targets = SCRIPTS[name]
    for option in sorted(options):
        assert option in text, f"{name} --help does not mention {option}"
    for target in targets:
        assert target in text, f"{name} --help does not state the target {target!r}"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_option_has_a_help_text_and_is_documented(
    name: str, load_script: Callable[[str], ModuleType]
) -> None:
    parser: argparse.ArgumentParser = load_script(name).build_parser()
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert {s for a in actions for s in a.option_strings if s.startswith("--")} == SCRIPTS[name][0]
    for action in actions:
        assert action.help and len(action.help) > 10, f"{name} {action.option_strings}: no help"


def test_gpu_carry_help_describes_every_option_of_every_verb() -> None:
    script = str(BENCHMARKS / "gpu_carry.py")
    expected = {
        "pack": ("--out", "--part-mib", "--python-version", "--no-sm100"),
        "assemble": ("--parts", "--wheels"),
        "install": ("--wheels",),
    }
    top = _help(sys.executable, script, "--help")
    for verb, options in expected.items():
        assert verb in top
        text = _help(sys.executable, script, verb, "--help").split("options:", 1)[1]
        for option in options:
            # "--opt METAVAR  help text": the option is followed by words beyond its metavar
            after = text.split(f" {option}", 1)[1].split(" --", 1)[0].split()
            assert len(after) >= 3, f"gpu_carry {verb} {option} has no help: {after}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_check_help_prints_its_header_and_runs_nothing(tmp_path: Path) -> None:
    text = _help("bash", str(BENCHMARKS / "gpu_check.sh"), "--help", cwd=tmp_path)
    assert "Usage" in text and "MOE_EP_CARRY_PARTS" in text and "Steps" in text
    assert not text.startswith("!")  # the shebang line is not part of the help
    assert list(tmp_path.iterdir()) == []  # no output folder made, no step run

"""`moe-ep tune`: the collective sweep picks the same knobs on every rank from the slowest
rank's timings (ranks whose local timings disagree, injected), agrees on the token bucket
by a max over ranks, resumes an interrupted sweep, and the GPU tuners' declared knobs are
fields of their config classes, exercised here with fake timings (never run on a GPU)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from moe_ep import spawn
from moe_ep.cli import EXIT_OK, EXIT_USAGE, main
from moe_ep.errors import MoeEpUsageError
from moe_ep.registry import get_kernel
from moe_ep.tune.sweep import Candidate, agreed_tokens, candidate_id
from moe_ep.tune.tuners import TuneJob, tune_rank, valid_grid
from moe_ep.tuning import TuningCache
from moe_ep.tuning.knobs import KNOBS, grid_of

PULL = "sm90_fp8_fp8_bf16_pull_cutedsl"


def _job(tmp_path: Path, kernel: str = "any_bf16_bf16_bf16_torch", tokens: int = 16) -> TuneJob:
    return TuneJob(kernel, tokens, 64, 32, 4, 2, ("uniform",), 1, 0, str(tmp_path / "t.json"))


# Fake timings (spawned: top level). Rank 0 finds dedup=True fastest, rank 1 dedup=False;
# rank 0 prefers the default thread count, rank 1 explicit ones. The slowest rank's times:
# (True, None) 5.6, (True, n) 5.0, (False, None) 3.0, (False, n) 3.5: every rank must pick
# (False, None), which neither rank's own timings would.
LOCAL = {0: {True: 1.0, False: 3.0}, 1: {True: 5.0, False: 2.0}}
THREADS = {0: {True: 0.0, False: 0.5}, 1: {True: 0.6, False: 0.0}}  # by "cpu_threads is None"


def _fake(rank: int, cand: Candidate) -> float:
    return LOCAL[rank][cand["dedup"]] + THREADS[rank][cand["cpu_threads"] is None]


def _disagreeing(job: TuneJob, rank: int, ws: int, boot: Any, rt: Any) -> Callable[..., float]:
    return lambda cand: _fake(rank, cand)


def _tune_and_bucket(rank: int, world_size: int, job: TuneJob) -> dict[str, Any]:
    winner = tune_rank(rank, world_size, job, _disagreeing)
    mine = dataclasses.replace(job, tokens=job.tokens + 100 * rank)  # ranks' live tokens differ
    from moe_ep import BootstrapConfig
    from moe_ep.runtime import acquire

    rt = acquire(BootstrapConfig(world_size, rank))
    try:
        agreed = agreed_tokens(rt, mine.tokens)
    finally:
        rt.release()
    return {"knobs": winner.knobs, "timings": winner.timings, "agreed": agreed}


@pytest.mark.multirank
def test_ranks_with_disagreeing_timings_pick_the_same_winner(tmp_path: Path) -> None:
    job = _job(tmp_path)
    got = spawn.spawn_local(_tune_and_bucket, 2, job, timeout_s=240)
    winner = {"dedup": False, "cpu_threads": None}
    assert got[0]["knobs"] == got[1]["knobs"] == winner
    grid = valid_grid(get_kernel(job.kernel), 2)
    assert {c["dedup"] for c in grid} == {True, False} and winner in grid
    expected = {candidate_id(c): max(_fake(0, c), _fake(1, c)) for c in grid}
    assert got[0]["timings"] == got[1]["timings"] == expected
    assert expected[candidate_id({"dedup": True, "cpu_threads": None})] == 5.6
    assert got[0]["agreed"] == got[1]["agreed"] == 116  # max(16, 116)
    doc = json.loads(Path(job.cache).read_text())
    (entry,) = doc["entries"].values()
    assert entry["knobs"] == winner and entry["seconds"] == 3.0
    (ident,) = doc["entries"]
    assert "|ws=2" in ident and "T<=16 " in ident


class _Stop(Exception):
    pass


def _fake_pull(calls: list[str], stop_after: int | None) -> Callable[..., Callable[..., float]]:
    """Fake timings of the sm90 pull grid: the atomic scheduler with a (2,1,1) cluster and
    the wide tile is fastest; `stop_after` candidates then an interruption."""

    def factory(*_: Any) -> Callable[[Candidate], float]:
        def measure(cand: Candidate) -> float:
            if stop_after is not None and len(calls) == stop_after:
                raise _Stop
            calls.append(candidate_id(cand))
            t = 10.0 - (cand["load_balance_mode"] == "atomic_counter") * 3
            t -= (cand["cluster_shape_mnk"] == (2, 1, 1)) * 2
            return t - (cand["mma_tiler_mnk"][1] == 256) * 1

        return measure  # fmt: skip

    return factory


def test_gpu_tuner_sweep_resumes_after_an_interruption(tmp_path: Path) -> None:
    job = _job(tmp_path, PULL)
    grid = valid_grid(get_kernel(PULL), 1)
    assert len(grid) >= 4
    first: list[str] = []
    with pytest.raises(_Stop):
        tune_rank(0, 1, job, _fake_pull(first, stop_after=3))
    assert len(first) == 3
    (sweep,) = json.loads(Path(job.cache).read_text())["sweeps"].values()
    assert set(sweep["timings"]) == set(first)  # the timed candidates survived the stop
    second: list[str] = []
    winner = tune_rank(0, 1, job, _fake_pull(second, stop_after=None))
    assert winner.resumed == 3 and not set(first) & set(second)  # none timed twice
    assert len(first) + len(second) == len(grid)
    fastest = min(grid, key=lambda c: _fake_pull([], None)()(c))
    assert winner.knobs == fastest
    assert json.loads(Path(job.cache).read_text())["sweeps"] == {}


@pytest.mark.parametrize("kernel", sorted(KNOBS))
def test_gpu_tuners_declare_fields_of_their_config_classes(kernel: str) -> None:
    config_cls = get_kernel(kernel).config_cls
    fields = {f.name for f in dataclasses.fields(config_cls)}
    assert set(grid_of(kernel)) <= fields
    assert valid_grid(get_kernel(kernel), 2)  # some candidates pass the config's own checks


def test_portable_knobs_are_config_fields_with_dedup_only_above_world_size_one() -> None:
    config_cls = get_kernel("any_bf16_bf16_bf16_torch").config_cls
    assert set(grid_of("any_bf16_bf16_bf16_torch")) <= {
        f.name for f in dataclasses.fields(config_cls)
    }
    assert set(grid_of("any_bf16_bf16_bf16_torch", 1)) == {"cpu_threads"}
    assert set(grid_of("any_fp8_fp8_bf16_torch", 2)) == {"dedup", "cpu_threads"}


def test_a_kernel_without_knobs_is_refused() -> None:
    kernel = "sm100_nvfp4_nvfp4_bf16_cutedsl"
    assert grid_of(kernel) == {}
    with pytest.raises(MoeEpUsageError, match=f"--kernel {kernel!r} has no tuning knobs at --ep 2"):
        valid_grid(get_kernel(kernel), 2)


def test_cli_refuses_bad_options_before_any_rank(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MOE_EP_TUNING_CACHE", str(tmp_path))
    assert main(["tune", "--kernel", "nope"]) == EXIT_USAGE
    assert "--kernel 'nope': unknown kernel" in capsys.readouterr().err
    assert main(["tune", "--ep", "3", "--shape", "8,64,32,4,2"]) == EXIT_USAGE
    assert "--ep must be >= 1 and divide the experts (4), got 3" in capsys.readouterr().err


@pytest.mark.multirank
def test_cli_tune_writes_the_winner_a_layer_then_reads(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MOE_EP_TUNING_CACHE", str(tmp_path))
    argv = ["tune", "--ep", "2", "--shape", "8,64,32,4,2", "--reps", "1", "--routing", "skewed"]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert "winner" in out and str(tmp_path / "tuning.json") in out
    assert TuningCache(tmp_path / "tuning.json").count() == 1
    assert main(["info"]) == EXIT_OK
    assert "tuning cache" in capsys.readouterr().out


def test_cli_tune_at_ep1_sweeps_the_thread_knob(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MOE_EP_TUNING_CACHE", str(tmp_path))
    argv = ["tune", "--ep", "1", "--shape", "8,64,32,4,2", "--reps", "1", "--routing", "uniform"]
    assert main(argv) == EXIT_OK
    assert "winner" in capsys.readouterr().out
    (entry,) = json.loads((tmp_path / "tuning.json").read_text())["entries"].values()
    assert set(entry["knobs"]) == {"cpu_threads"}
    assert len(entry["timings"]) == len(valid_grid(get_kernel("any_bf16_bf16_bf16_torch"), 1))

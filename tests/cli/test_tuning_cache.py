"""The tuning cache: atomic, lock-protected writes (concurrent writers lose nothing, readers
never see a torn file); corrupted and stale entries reported and ignored; a layer built
from a kernel name uses a cached winner, and falls back to the defaults when it is absent,
stale or refused; an explicit config is never overridden."""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEWeightPack
from moe_ep.backends.portable.configs import Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig
from moe_ep.registry import get_kernel
from moe_ep.spawn import free_port
from moe_ep.tuning import TuningCache, TuningKey, cache_path, tokens_bucket
from moe_ep.tuning.cache import TuningCacheWarning, arch_of, versions
from moe_ep.tuning.lookup import key_for

KERNEL = "any_bf16_bf16_bf16_torch"
VERSIONS = {"moe-ep-core": "0.1.0", "torch": "2.15.0"}


def _key(i: int = 0, versions: dict[str, str] = VERSIONS) -> TuningKey:
    return TuningKey(KERNEL, "cpu:x:threads=1", (64, 128, 64, 8 + i), 2, versions)


def test_tokens_bucket_is_the_next_power_of_two() -> None:
    assert [tokens_bucket(n) for n in (0, 1, 2, 3, 64, 65, 4096)] == [1, 1, 2, 4, 64, 128, 4096]


def test_record_then_lookup_and_sweep_timings(tmp_path: Path) -> None:
    cache = TuningCache(tmp_path / "tuning.json")
    assert cache.lookup(_key()) is None  # no file: a miss, nothing reported
    cache.save_timing(_key(), '{"dedup": true}', 0.5)
    assert cache.sweep(_key()) == {'{"dedup": true}': 0.5}
    assert cache.sweep(_key(versions={"torch": "other"})) == {}  # another version's sweep
    cache.record(_key(), {"dedup": False}, 0.25, {'{"dedup": false}': 0.25})
    assert cache.lookup(_key()) == {"dedup": False}
    assert cache.sweep(_key()) == {}  # the finished sweep's record is dropped
    assert cache.count() == 1


@pytest.mark.parametrize(
    ("text", "why"),
    [("{not json", "is not JSON"), ('{"schema": "other"}', "is not a tuning cache")],
)
def test_corrupted_file_is_reported_and_ignored(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "tuning.json"
    path.write_text(text)
    with pytest.warns(TuningCacheWarning, match=why):
        assert TuningCache(path).lookup(_key()) is None
    with pytest.warns(TuningCacheWarning):  # a write replaces the corrupted file
        TuningCache(path).record(_key(), {"dedup": False}, 1.0, {})
    assert TuningCache(path).lookup(_key()) == {"dedup": False}


def test_corrupted_and_stale_entries_are_reported_and_ignored(tmp_path: Path) -> None:
    path = tmp_path / "tuning.json"
    cache = TuningCache(path)
    cache.record(_key(), {"dedup": False}, 1.0, {})
    doc = json.loads(path.read_text())
    doc["entries"][_key(1).ident()] = {"knobs": "dedup"}  # no versions, knobs not a dict
    path.write_text(json.dumps(doc))
    with pytest.warns(TuningCacheWarning, match="does not parse"):
        assert cache.lookup(_key(1)) is None
    newer = _key(versions={**VERSIONS, "torch": "2.16.0"})
    with pytest.warns(TuningCacheWarning, match=r"is stale.*torch.*2\.15\.0.*2\.16\.0"):
        assert cache.lookup(newer) is None


def _writer(path: str, worker: int, n: int) -> None:
    cache = TuningCache(Path(path))
    for i in range(n):
        cache.record(_key(100 * worker + i), {"dedup": bool(i % 2)}, float(i), {})


def test_concurrent_writers_lose_nothing_and_readers_never_see_a_torn_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tuning.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 15)) for w in range(4)]
    for p in procs:
        p.start()
    reads = 0
    while any(p.is_alive() for p in procs):
        if path.exists():
            json.loads(path.read_text())  # always a whole document
            reads += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert reads > 0
    assert TuningCache(path).count() == 60
    leftovers = [
        p.name for p in tmp_path.iterdir() if p.name not in ("tuning.json", "tuning.json.lock")
    ]
    assert leftovers == []  # no temporary file left behind


# -- the layer's lookup at construction (EP1, in this process) ---------------------------


def _config_of(backend: object) -> Any:
    """The config of an EP1 layer built with `backend` (the layer destroyed again)."""
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 64, 64, generator=g).bfloat16()
    w2 = torch.randn(4, 64, 32, generator=g).bfloat16()
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    layer = MoEEpLayer(boot, FleetParams(4, 16, 64), MoEWeightPack(w13, w2), backend)  # type: ignore[arg-type]
    try:
        return layer.config
    finally:
        layer.destroy()


def _cache_winner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **versions: str) -> Path:
    monkeypatch.setenv("MOE_EP_TUNING_CACHE", str(tmp_path))
    key = key_for(get_kernel(KERNEL), 16, 64, 32, 4, 1, None)
    if versions:
        key = TuningKey(key.kernel, key.arch, key.bucket, key.world_size, versions)
    path = cache_path(create=True)
    TuningCache(path).record(key, {"dedup": False}, 1.0, {})
    return path


def test_layer_uses_the_cached_winner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _cache_winner(monkeypatch, tmp_path)
    config = _config_of(KERNEL)
    assert config.dedup is False  # the default is True


def test_layer_uses_a_cached_thread_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOE_EP_TUNING_CACHE", str(tmp_path))
    key = key_for(get_kernel(KERNEL), 16, 64, 32, 4, 1, None)
    TuningCache(cache_path(create=True)).record(key, {"cpu_threads": 1}, 1.0, {})
    assert _config_of(KERNEL).cpu_threads == 1  # the default is None


def test_layer_falls_back_to_defaults_when_absent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MOE_EP_TUNING_CACHE", str(tmp_path / "empty"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningCacheWarning)
        config = _config_of(KERNEL)
    assert config == Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig()


def test_layer_reports_and_ignores_a_stale_winner(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _cache_winner(monkeypatch, tmp_path, torch="0.0.1", **{"moe-ep-core": "0.0.1"})
    with pytest.warns(TuningCacheWarning, match="is stale"):
        config = _config_of(KERNEL)
    assert config.dedup is True


def test_layer_refuses_a_cached_field_that_is_not_a_knob(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = _cache_winner(monkeypatch, tmp_path)
    doc = json.loads(path.read_text())
    (entry,) = doc["entries"].values()
    entry["knobs"] = {"swiglu_clamp": 1.0}  # changes the math: never a knob
    path.write_text(json.dumps(doc))
    with pytest.warns(TuningCacheWarning, match="not tuning knobs"):
        config = _config_of(KERNEL)
    assert config.swiglu_clamp is None


def test_an_explicit_config_is_never_overridden(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _cache_winner(monkeypatch, tmp_path)
    config = _config_of(Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(dedup=True))
    assert config.dedup is True


def test_cpu_arch_names_the_machine_and_thread_count() -> None:
    assert arch_of(None).startswith("cpu:") and f"threads={torch.get_num_threads()}" in arch_of(
        None
    )


def test_versions_name_a_backend_package_and_its_requirements(tmp_path: Path) -> None:
    """A GPU kernel's entry goes stale when its backend package or what that package
    requires (the CuTe DSL, NVSHMEM, the drops) changes version; a portable kernel's when
    moe-ep-core or torch does."""
    assert set(versions("moe_ep.backends.portable.kernel")) == {"moe-ep-core", "torch"}
    pytest.importorskip("moe_ep_sm90")
    got = versions("moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_pull_cutedsl.kernel")
    assert {
        "moe-ep-core",
        "torch",
        "moe-ep-backends-sm90",
        "nvidia-cutlass-dsl",
        "nvshmem4py-cu13",
        "cuda-bindings",
        "moe-ep-drop-sm90-pull-cutedsl",
    } <= set(got)
    assert got["moe-ep-backends-sm90"] == importlib.metadata.version("moe-ep-backends-sm90")
    old = {**got, "nvidia-cutlass-dsl": "0.0.1"}
    cache = TuningCache(tmp_path / "tuning.json")
    cache.record(_key(versions=old), {"mma_tiler_mnk": [64, 128, 128]}, 1.0, {})
    with pytest.warns(TuningCacheWarning, match="stale: measured under other versions of nvidia"):
        assert cache.lookup(_key(versions=got)) is None


def test_info_shows_the_cache_location_and_its_entries(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from moe_ep.cli.report import environment_report

    monkeypatch.setenv("MOE_EP_TUNING_CACHE", str(tmp_path))
    assert environment_report()["tuning cache"] == f"{tmp_path / 'tuning.json'} (none yet)"
    TuningCache(tmp_path / "tuning.json").record(_key(), {"dedup": False}, 1.0, {})
    assert environment_report()["tuning cache"] == f"{tmp_path / 'tuning.json'} (1 entries)"

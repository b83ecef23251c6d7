"""Device resolution: precedence, the gated fold, validation, the host-binding warning."""

from __future__ import annotations

import warnings

import pytest

from moe_ep import BootstrapConfig, resolve_local_device
from moe_ep import device as device_mod
from moe_ep.device import describe_device_resolution, resolve_device_detailed
from moe_ep.errors import MoeEpUsageError

# (explicit device, env, rank, world_size, device_count) -> expected ordinal
TABLE = [
    pytest.param(1, {"LOCAL_RANK": "0"}, 2, 4, 4, 1, id="explicit-beats-LOCAL_RANK-and-rank"),
    pytest.param(None, {"LOCAL_RANK": "3"}, 1, 4, 4, 3, id="LOCAL_RANK-beats-rank"),
    pytest.param(None, {}, 2, 4, 4, 2, id="rank-when-LOCAL_RANK-unset"),
    pytest.param(None, {"LOCAL_RANK": ""}, 2, 4, 4, 2, id="empty-LOCAL_RANK-is-unset"),
    pytest.param(0, {}, 3, 4, 1, 0, id="explicit-0"),
    pytest.param(None, {"LOCAL_RANK": "5"}, 0, 8, 0, None, id="no-cuda-is-cpu"),
    pytest.param(7, {}, 0, 8, 0, None, id="no-cuda-is-cpu-even-explicit"),
    # the fold applies only under MEGA_SINGLE_GPU_GLOO=1
    pytest.param(None, {"MEGA_SINGLE_GPU_GLOO": "1"}, 5, 8, 2, 1, id="fold-rank"),
    pytest.param(
        None, {"MEGA_SINGLE_GPU_GLOO": "1", "LOCAL_RANK": "3"}, 0, 8, 1, 0, id="fold-1gpu"
    ),
    pytest.param(3, {"MEGA_SINGLE_GPU_GLOO": "1"}, 0, 8, 2, 1, id="fold-explicit"),
    pytest.param(None, {"MEGA_SINGLE_GPU_GLOO": "0"}, 1, 8, 2, 1, id="fold-off-in-range"),
]


@pytest.mark.parametrize(("device", "env", "rank", "world", "count", "expected"), TABLE)
def test_precedence_table(device, env, rank, world, count, expected) -> None:
    cfg = BootstrapConfig(world, rank, device=device)
    assert resolve_local_device(cfg, env=env, device_count=count) == expected


@pytest.mark.parametrize(
    ("device", "env", "rank", "source"),
    [
        (None, {"CUDA_VISIBLE_DEVICES": "0,1"}, 5, "BootstrapConfig.rank=5"),
        (None, {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1"}, 0, "LOCAL_RANK=3"),
        (2, {"CUDA_VISIBLE_DEVICES": "0,1"}, 0, "BootstrapConfig.device=2"),
        (None, {"MEGA_SINGLE_GPU_GLOO": "0", "CUDA_VISIBLE_DEVICES": "0,1"}, 2, "rank=2"),
    ],
)
def test_out_of_range_names_source_and_visible_devices(device, env, rank, source) -> None:
    cfg = BootstrapConfig(8, rank, device=device)
    with pytest.raises(MoeEpUsageError) as info:
        resolve_local_device(cfg, env=env, device_count=2)
    msg = str(info.value)
    assert source in msg and "CUDA_VISIBLE_DEVICES='0,1'" in msg and "2 visible" in msg


def test_out_of_range_with_cuda_visible_devices_unset() -> None:
    with pytest.raises(MoeEpUsageError, match=r"CUDA_VISIBLE_DEVICES=\(unset\)"):
        resolve_local_device(BootstrapConfig(4, 1), env={}, device_count=1)


@pytest.mark.parametrize("bad", ["abc", "-1", "1.5", " x "])
@pytest.mark.parametrize("count", [0, 4])
def test_malformed_local_rank_is_an_error(bad: str, count: int) -> None:
    # an error on every machine, CPU-only ones included, so a broken launcher shows up early
    with pytest.raises(MoeEpUsageError) as info:
        resolve_local_device(BootstrapConfig(4, 0), env={"LOCAL_RANK": bad}, device_count=count)
    assert "LOCAL_RANK" in str(info.value) and repr(bad.strip()) in str(info.value)


def test_explicit_device_ignores_malformed_local_rank() -> None:
    cfg = BootstrapConfig(4, 0, device=1)
    assert resolve_local_device(cfg, env={"LOCAL_RANK": "abc"}, device_count=2) == 1


def test_malformed_fold_variable() -> None:
    with pytest.raises(MoeEpUsageError, match=r"MEGA_SINGLE_GPU_GLOO.*'true'"):
        resolve_local_device(
            BootstrapConfig(2, 0), env={"MEGA_SINGLE_GPU_GLOO": "true"}, device_count=1
        )


@pytest.mark.parametrize("count", [-1, True, 1.0, "2"])
def test_bad_device_count(count: object) -> None:
    with pytest.raises(MoeEpUsageError, match="device_count"):
        resolve_local_device(BootstrapConfig(1, 0), env={}, device_count=count)  # type: ignore[arg-type]


def test_config_type_checked() -> None:
    with pytest.raises(MoeEpUsageError, match="BootstrapConfig"):
        resolve_local_device((1, 0), env={}, device_count=1)  # type: ignore[arg-type]


def test_defaults_read_os_environ_and_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("MEGA_SINGLE_GPU_GLOO", raising=False)
    assert resolve_local_device(BootstrapConfig(4, 3), device_count=4) == 1
    if torch.cuda.is_available():
        pytest.skip("default device_count is only predictable without CUDA")
    assert resolve_local_device(BootstrapConfig(4, 3)) is None


def test_detailed_source_and_fold_flag() -> None:
    res = resolve_device_detailed(
        BootstrapConfig(8, 5), env={"MEGA_SINGLE_GPU_GLOO": "1"}, device_count=2
    )
    assert (res.ordinal, res.folded, res.device_count) == (1, True, 2)
    assert "rank=5" in res.source


@pytest.fixture
def fresh_warning_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_mod, "_warned", False)


@pytest.mark.usefixtures("fresh_warning_state")
def test_warns_once_when_host_bound_another_device() -> None:
    cfg = BootstrapConfig(4, 0)
    res = resolve_device_detailed(cfg, env={"LOCAL_RANK": "2"}, device_count=4)
    with pytest.warns(RuntimeWarning) as record:
        assert device_mod.warn_if_host_bound_elsewhere(cfg, res, current_device=1)
    msg = str(record[0].message)
    assert "cuda:2" in msg and "cuda:1" in msg and "LOCAL_RANK=2" in msg
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not device_mod.warn_if_host_bound_elsewhere(cfg, res, current_device=3)


@pytest.mark.usefixtures("fresh_warning_state")
@pytest.mark.parametrize(
    ("device", "current"),
    [(None, 2), (None, None), (1, 3)],
    ids=["same-device", "host-bound-nothing", "explicit-device"],
)
def test_no_warning(device: int | None, current: int | None) -> None:
    cfg = BootstrapConfig(4, 0, device=device)
    res = resolve_device_detailed(cfg, env={"LOCAL_RANK": "2"}, device_count=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not device_mod.warn_if_host_bound_elsewhere(cfg, res, current_device=current)


def test_describe_device_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_mod, "_torch_device_count", lambda: 2)
    line = describe_device_resolution({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5"})
    assert line.startswith("cuda:1") and "LOCAL_RANK=1" in line and "'4,5'" in line
    folded = describe_device_resolution({"RANK": "3", "MEGA_SINGLE_GPU_GLOO": "1"})
    assert folded.startswith("cuda:1") and "MEGA_SINGLE_GPU_GLOO" in folded
    assert describe_device_resolution({"LOCAL_RANK": "abc"}).startswith("error:")
    monkeypatch.setattr(device_mod, "_torch_device_count", lambda: 0)
    assert describe_device_resolution({}).startswith("cpu")

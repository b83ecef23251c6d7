"""BootstrapConfig: positional binding, keyword-only fields, validation messages."""

from __future__ import annotations

import dataclasses
import math

import pytest

from moe_ep import BootstrapConfig
from moe_ep.errors import MoeEpUsageError

# flashinfer-python 0.7.4's positional fields, in its order (tests/compat checks its wheel)
POSITIONAL = (
    "world_size", "rank", "stream", "auto_bootstrap", "nccl_comm", "process_group", "tcp_store",
)  # fmt: skip


def test_public_name_is_the_config_class() -> None:
    from moe_ep.config import BootstrapConfig as direct

    assert BootstrapConfig is direct


def test_positional_binding_of_the_original_fields() -> None:
    group = object()
    cfg = BootstrapConfig(4, 3, 7, False, None, group)
    assert (cfg.world_size, cfg.rank, cfg.stream, cfg.auto_bootstrap) == (4, 3, 7, False)
    assert cfg.process_group is group
    assert (cfg.device, cfg.init_method, cfg.timeout_s) == (None, None, None)


def test_only_the_original_fields_are_positional() -> None:
    fields = dataclasses.fields(BootstrapConfig)
    positional = tuple(f.name for f in fields if not f.kw_only)
    assert positional == POSITIONAL
    later = [f.name for f in fields if f.kw_only]
    assert "device" in later and later == [f.name for f in fields[len(POSITIONAL) :]]
    # an eighth positional argument has nowhere to go, whatever fields get added later
    with pytest.raises(TypeError):
        BootstrapConfig(4, 3, 0, True, None, None, None, 1)  # type: ignore[call-arg]


def test_keyword_only_fields_bind_by_name() -> None:
    cfg = BootstrapConfig(2, 1, device=5, init_method="tcp://h:1", timeout_s=3)
    assert (cfg.device, cfg.init_method, cfg.timeout_s) == (5, "tcp://h:1", 3.0)
    assert isinstance(cfg.timeout_s, float)


def test_frozen() -> None:
    cfg = BootstrapConfig(2, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rank = 1  # type: ignore[misc]


BAD = [
    ({"world_size": 0, "rank": 0}, "world_size", "0"),
    ({"world_size": -2, "rank": 0}, "world_size", "-2"),
    ({"world_size": True, "rank": 0}, "world_size", "True"),
    ({"world_size": 2.0, "rank": 0}, "world_size", "2.0"),
    ({"world_size": "2", "rank": 0}, "world_size", "'2'"),
    ({"world_size": 2, "rank": -1}, "rank", "-1"),
    ({"world_size": 2, "rank": 2}, "rank", "rank=2"),
    ({"world_size": 2, "rank": False}, "rank", "False"),
    ({"world_size": 2, "rank": 0, "stream": -1}, "stream", "-1"),
    ({"world_size": 2, "rank": 0, "stream": True}, "stream", "True"),
    ({"world_size": 2, "rank": 0, "auto_bootstrap": 1}, "auto_bootstrap", "1"),
    ({"world_size": 2, "rank": 0, "auto_bootstrap": "yes"}, "auto_bootstrap", "'yes'"),
    ({"world_size": 2, "rank": 0, "process_group": "ep"}, "process_group", "'ep'"),
    ({"world_size": 2, "rank": 0, "device": -1}, "device", "-1"),
    ({"world_size": 2, "rank": 0, "device": "cuda:0"}, "device", "'cuda:0'"),
    ({"world_size": 2, "rank": 0, "device": "0"}, "device", "'0'"),
    ({"world_size": 2, "rank": 0, "device": True}, "device", "True"),
    ({"world_size": 2, "rank": 0, "device": 1.0}, "device", "1.0"),
    ({"world_size": 2, "rank": 0, "init_method": "localhost:29500"}, "init_method", "localhost"),
    ({"world_size": 2, "rank": 0, "init_method": 29500}, "init_method", "29500"),
    ({"world_size": 2, "rank": 0, "timeout_s": 0}, "timeout_s", "0"),
    ({"world_size": 2, "rank": 0, "timeout_s": -5.0}, "timeout_s", "-5.0"),
    ({"world_size": 2, "rank": 0, "timeout_s": math.inf}, "timeout_s", "inf"),
    ({"world_size": 2, "rank": 0, "timeout_s": math.nan}, "timeout_s", "nan"),
    ({"world_size": 2, "rank": 0, "timeout_s": True}, "timeout_s", "True"),
    ({"world_size": 2, "rank": 0, "timeout_s": "5"}, "timeout_s", "'5'"),
]


@pytest.mark.parametrize(("kwargs", "field", "shown"), BAD)
def test_validation_names_field_and_value(kwargs: dict, field: str, shown: str) -> None:
    with pytest.raises(MoeEpUsageError) as info:
        BootstrapConfig(**kwargs)
    msg = str(info.value)
    assert f"BootstrapConfig.{field}" in msg and shown in msg
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("world_size", "rank"), [(1, 0), (4, 3), (1024, 1023)])
def test_valid_ranges_accepted(world_size: int, rank: int) -> None:
    cfg = BootstrapConfig(world_size, rank, device=0)
    assert (cfg.world_size, cfg.rank, cfg.device) == (world_size, rank, 0)


def test_effective_timeout_precedence() -> None:
    assert BootstrapConfig(1, 0).effective_timeout_s({}) == 120.0
    assert BootstrapConfig(1, 0).effective_timeout_s({"MOE_EP_TIMEOUT_S": "7.5"}) == 7.5
    explicit = BootstrapConfig(1, 0, timeout_s=2)
    assert explicit.effective_timeout_s({"MOE_EP_TIMEOUT_S": "7.5"}) == 2.0
    # explicit wins even over a malformed variable, which is then never read
    assert explicit.effective_timeout_s({"MOE_EP_TIMEOUT_S": "soon"}) == 2.0
    with pytest.raises(MoeEpUsageError, match="MOE_EP_TIMEOUT_S"):
        BootstrapConfig(1, 0).effective_timeout_s({"MOE_EP_TIMEOUT_S": "soon"})

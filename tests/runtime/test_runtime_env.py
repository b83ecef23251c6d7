"""moe_ep.env: every variable parsed in one place; malformed values name the variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from moe_ep import env
from moe_ep.errors import MoeEpUsageError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("reader", "name", "value", "expected"),
    [
        (env.local_rank, "LOCAL_RANK", "3", 3),
        (env.local_rank, "LOCAL_RANK", " 0 ", 0),
        (env.local_rank, "LOCAL_RANK", "", None),
        (env.torchrun_rank, "RANK", "7", 7),
        (env.torchrun_world_size, "WORLD_SIZE", "8", 8),
        (env.single_gpu_gloo, "MEGA_SINGLE_GPU_GLOO", "1", True),
        (env.single_gpu_gloo, "MEGA_SINGLE_GPU_GLOO", "0", False),
        (env.torchelastic_agent_store, "TORCHELASTIC_USE_AGENT_STORE", "True", True),
        (env.torchelastic_agent_store, "TORCHELASTIC_USE_AGENT_STORE", "False", False),
        (env.timeout_s, "MOE_EP_TIMEOUT_S", "2.5", 2.5),
        (env.timeout_s, "MOE_EP_TIMEOUT_S", "30", 30.0),
    ],
)
def test_parses(reader, name: str, value: str, expected) -> None:
    assert reader({name: value}) == expected


@pytest.mark.parametrize(
    ("reader", "unset"),
    [
        (env.local_rank, None),
        (env.torchrun_rank, None),
        (env.torchrun_world_size, None),
        (env.single_gpu_gloo, False),
        (env.torchelastic_agent_store, False),
        (env.timeout_s, None),
        (env.master_addr_port, None),
    ],
)
def test_unset(reader, unset) -> None:
    assert reader({}) == unset


@pytest.mark.parametrize(
    ("reader", "name", "value"),
    [
        (env.local_rank, "LOCAL_RANK", "abc"),
        (env.local_rank, "LOCAL_RANK", "-1"),
        (env.local_rank, "LOCAL_RANK", "1.5"),
        (env.local_rank, "LOCAL_RANK", "0x1"),
        (env.torchrun_rank, "RANK", "-3"),
        (env.torchrun_world_size, "WORLD_SIZE", "0"),
        (env.single_gpu_gloo, "MEGA_SINGLE_GPU_GLOO", "yes"),
        (env.single_gpu_gloo, "MEGA_SINGLE_GPU_GLOO", "2"),
        (env.torchelastic_agent_store, "TORCHELASTIC_USE_AGENT_STORE", "yes"),
        (env.timeout_s, "MOE_EP_TIMEOUT_S", "0"),
        (env.timeout_s, "MOE_EP_TIMEOUT_S", "-1"),
        (env.timeout_s, "MOE_EP_TIMEOUT_S", "inf"),
        (env.timeout_s, "MOE_EP_TIMEOUT_S", "nan"),
        (env.timeout_s, "MOE_EP_TIMEOUT_S", "ten"),
    ],
)
def test_malformed_names_variable_and_value(reader, name: str, value: str) -> None:
    with pytest.raises(MoeEpUsageError) as info:
        reader({name: value})
    assert name in str(info.value) and repr(value) in str(info.value)


def test_master_addr_port() -> None:
    assert env.master_addr_port({"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}) == (
        "node0",
        29500,
    )
    with pytest.raises(MoeEpUsageError, match="MASTER_PORT is unset"):
        env.master_addr_port({"MASTER_ADDR": "node0"})
    with pytest.raises(MoeEpUsageError, match="MASTER_ADDR is unset"):
        env.master_addr_port({"MASTER_PORT": "29500"})
    with pytest.raises(MoeEpUsageError, match=r"MASTER_PORT.*70000"):
        env.master_addr_port({"MASTER_ADDR": "node0", "MASTER_PORT": "70000"})
    with pytest.raises(MoeEpUsageError, match=r"MASTER_PORT.*'http'"):
        env.master_addr_port({"MASTER_ADDR": "node0", "MASTER_PORT": "http"})


def test_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert env.local_rank() == 5
    monkeypatch.setenv("LOCAL_RANK", "five")
    with pytest.raises(MoeEpUsageError, match="LOCAL_RANK"):
        env.local_rank()


ENV_MODULES = [
    ROOT / "packages/moe-ep-core/src/moe_ep/env.py",
    *sorted(ROOT.glob("packages/moe-ep-backends-*/src/*/env.py")),
]


def _names_read_by_env_modules() -> set[str]:
    names: set[str] = set()
    for path in ENV_MODULES:
        source = path.read_text()
        names |= set(re.findall(r'(?:raw_value|_int|absolute_dir)\(env, "([A-Z_]+)"', source))
        names |= set(re.findall(r'\.get\("([A-Z_]+)"\)', source))
    return names


def test_every_variable_read_is_documented() -> None:
    assert len(ENV_MODULES) >= 2  # core's and at least the sm90 package's
    read = _names_read_by_env_modules()
    assert {"LOCAL_RANK", "MEGA_SINGLE_GPU_GLOO", "MOE_EP_TIMEOUT_S", "MASTER_PORT"} <= read
    table = {n.strip() for var in env.all_env_vars() for n in var.name.split(",")}
    assert read <= table, read - table
    doc = (ROOT / "docs/runtime.md").read_text()
    missing = [name for name in sorted(read) if f"`{name}`" not in doc]
    assert not missing, f"docs/runtime.md does not document {missing}"


def test_no_other_core_runtime_module_reads_the_environment() -> None:
    src = ROOT / "packages/moe-ep-core/src/moe_ep"
    files = [src / n for n in ("config.py", "device.py", "spawn.py")]
    files += sorted((src / "runtime").glob("*.py"))
    assert len(files) >= 5
    for path in files:
        name = path.relative_to(src)
        text = path.read_text()
        reads = re.findall(r"os\.environ(?:\.get)?\[?\(?\"([A-Z_]+)", text) + re.findall(
            r"os\.getenv\(", text
        )
        assert not reads, f"{name} reads {reads} directly; go through moe_ep.env"


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (None, 1 << 30),  # NVSHMEM's default
        ("4096", 4096),
        ("20m", 20 << 20),
        ("3.1M", 3250586),  # NVSHMEM's own examples: ceil(3.1 * 2**20)
        (".5m", 1 << 19),
        ("2G", 2 << 30),
        ("20kk", 20 << 10),  # one multiplier; what follows is ignored
    ],
)
def test_nvshmem_symmetric_size_reads_as_nvshmem_does(raw: str | None, want: int) -> None:
    e = {} if raw is None else {"NVSHMEM_SYMMETRIC_SIZE": raw}
    assert env.nvshmem_symmetric_size(e) == want


@pytest.mark.parametrize("raw", ["abc", "-1g", "g"])
def test_a_malformed_nvshmem_symmetric_size_is_named(raw: str) -> None:
    with pytest.raises(MoeEpUsageError, match=rf"NVSHMEM_SYMMETRIC_SIZE .*got '{raw}'"):
        env.nvshmem_symmetric_size({"NVSHMEM_SYMMETRIC_SIZE": raw})


@pytest.mark.parametrize(
    ("reader", "name", "value", "rule"),
    [
        (env.timeout_s, "MOE_EP_TIMEOUT_S", "1e15", "<= 604800"),  # timedelta overflowed
        (env.timeout_s, "MOE_EP_TIMEOUT_S", "604801", "<= 604800"),
        (env.local_rank, "LOCAL_RANK", str(2**31), "0..2147483647"),
        (env.torchrun_rank, "RANK", "9" * 30, "0..2147483647"),
        (env.torchrun_world_size, "WORLD_SIZE", str(2**31), "1..2147483647"),
        (env.nvshmem_symmetric_size, "NVSHMEM_SYMMETRIC_SIZE", "1e400", "> 0 and < 2**63"),
        (env.nvshmem_symmetric_size, "NVSHMEM_SYMMETRIC_SIZE", "1e19", "> 0 and < 2**63"),
        (env.nvshmem_symmetric_size, "NVSHMEM_SYMMETRIC_SIZE", "0", "> 0 and < 2**63"),
        (env.debug, "MOE_EP_DEBUG", "yes", "0 or 1"),
    ],
)
def test_every_range_is_checked(reader, name: str, value: str, rule: str) -> None:
    with pytest.raises(MoeEpUsageError) as info:
        reader({name: value})
    msg = str(info.value)
    assert name in msg and repr(value) in msg and rule in msg


def test_the_largest_values_in_range_are_accepted() -> None:
    assert env.timeout_s({"MOE_EP_TIMEOUT_S": "604800"}) == env.MAX_TIMEOUT_S
    assert env.torchrun_world_size({"WORLD_SIZE": str(2**31 - 1)}) == 2**31 - 1
    assert env.nvshmem_symmetric_size({"NVSHMEM_SYMMETRIC_SIZE": "8e18"}) == 8 * 10**18


def test_a_timeout_of_1e15_is_a_usage_error_in_the_config_too() -> None:
    import datetime

    from moe_ep import BootstrapConfig

    with pytest.raises(OverflowError):  # what the runtime would have met
        datetime.timedelta(seconds=1e15)
    with pytest.raises(
        MoeEpUsageError, match=r"timeout_s must be .*<= 604800.*got 1000000000000000.0"
    ):
        BootstrapConfig(1, 0, timeout_s=1e15)
    with pytest.raises(MoeEpUsageError, match="MOE_EP_TIMEOUT_S"):
        BootstrapConfig(1, 0).effective_timeout_s({"MOE_EP_TIMEOUT_S": "1e15"})


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, None),
        ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),
        ({"RANK": "1"}, "WORLD_SIZE is unset"),
        ({"WORLD_SIZE": "2"}, "RANK is unset"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK must be < WORLD_SIZE, got RANK=2, WORLD_SIZE=2"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer in 0..2147483647, got 'x'"),
    ],
)
def test_torchrun_rank_and_world_size(values: dict[str, str], expected: object) -> None:
    if isinstance(expected, str):
        with pytest.raises(MoeEpUsageError, match=re.escape(expected)):
            env.torchrun_rank_and_world_size(values)
    else:
        assert env.torchrun_rank_and_world_size(values) == expected


# One malformed value per documented variable; the free-form ones take any string.
MALFORMED = {
    "LOCAL_RANK": "-1",
    "MEGA_SINGLE_GPU_GLOO": "yes",
    "MOE_EP_TIMEOUT_S": "abc",
    "MASTER_ADDR, MASTER_PORT": ("MASTER_PORT", "70000"),
    "RANK, WORLD_SIZE": ("RANK", "x"),
    "TORCHELASTIC_USE_AGENT_STORE": "1",
    "MOE_EP_PUSH_BUILD": "2",
    "MOE_EP_CPU_FUSED": "on",
    "MOE_EP_PUSH_CACHE": "relative/dir",
    "MOE_EP_CPU_FUSED_CACHE": "relative/dir",
    "MOE_EP_CUTEDSL_CACHE": "relative/dir",
    "MOE_EP_TUNING_CACHE": "relative/dir",
    "NVSHMEM_SYMMETRIC_SIZE": "-1g",
    "MOE_EP_DEBUG": "true",
}
FREE_FORM = {
    "CUDA_VISIBLE_DEVICES": "only echoed in messages (CUDA parses it)",
    "HOME": "checked only where the caches' defaults need it (moe_ep.cache_trust)",
    "CUTE_DSL_ARCH": "compared as written with the compile checks' --arch",
    "CC": "a command or path; a missing one is the fused epilogues' unavailability reason",
}


def test_every_documented_variable_is_either_checked_or_free_form() -> None:
    assert {v.name for v in env.all_env_vars()} == set(MALFORMED) | set(FREE_FORM)
    assert not set(MALFORMED) & set(FREE_FORM)


def _malformed_env(entry: str) -> tuple[str, dict[str, str]]:
    bad = MALFORMED[entry]
    name, value = bad if isinstance(bad, tuple) else (entry, bad)
    values = {"MASTER_ADDR": "node0", "WORLD_SIZE": "2"} if "," in entry else {}
    return name, {**values, name: value}


@pytest.mark.parametrize("entry", sorted(MALFORMED))
def test_check_all_names_each_malformed_variable(entry: str) -> None:
    name, values = _malformed_env(entry)
    with pytest.raises(MoeEpUsageError, match=f"environment variable {name} ") as info:
        env.check_all(values)
    assert repr(values[name]) in str(info.value)


def test_check_all_names_every_malformed_variable_at_once() -> None:
    values = {"MOE_EP_TIMEOUT_S": "1e15", "LOCAL_RANK": "x", "MOE_EP_CPU_FUSED": "on"}
    with pytest.raises(MoeEpUsageError) as info:
        env.check_all(values)
    assert all(name in str(info.value) for name in values)
    env.check_all({name: "anything at all" for name in FREE_FORM})

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


def _names_read_by_env_module() -> set[str]:
    source = (ROOT / "packages/moe-ep-core/src/moe_ep/env.py").read_text()
    return set(re.findall(r'_(?:raw|int)\(env, "([A-Z_]+)"', source)) | set(
        re.findall(r'\.get\("([A-Z_]+)"\)', source)
    )


def test_every_variable_read_is_documented() -> None:
    read = _names_read_by_env_module()
    assert {"LOCAL_RANK", "MEGA_SINGLE_GPU_GLOO", "MOE_EP_TIMEOUT_S", "MASTER_PORT"} <= read
    table = {n.strip() for var in env.ENV_VARS for n in var.name.split(",")}
    assert read <= table, read - table
    doc = (ROOT / "docs/runtime.md").read_text()
    missing = [name for name in sorted(read) if f"`{name}`" not in doc]
    assert not missing, f"docs/runtime.md does not document {missing}"


def test_no_other_core_runtime_module_reads_the_environment() -> None:
    src = ROOT / "packages/moe-ep-core/src/moe_ep"
    files = [src / n for n in ("config.py", "device.py", "launch.py")]
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

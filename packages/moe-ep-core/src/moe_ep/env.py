"""Every environment variable moe-ep reads, parsed in one place.

Rules: explicit arguments always win over the environment (callers only consult these
readers when the matching argument was not given); an unset or empty variable means "not
set"; a malformed value raises `MoeEpUsageError` naming the variable, the rule and the value.
The table in docs/runtime.md mirrors `all_env_vars()`: core's `ENV_VARS` plus the
variables each backend package owns and reads itself (its `env` module, listed in the
`moe_ep.env` entry-point group, with the readers of `raw_value`, `zero_one`,
`absolute_dir`).

This module imports nothing heavy (no torch), so `moe-ep info` and config validation can use
it anywhere.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from moe_ep.errors import MoeEpUsageError

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "ENV_ENTRY_POINT_GROUP",
    "ENV_VARS",
    "MAX_TIMEOUT_S",
    "EnvVar",
    "absolute_dir",
    "all_env_vars",
    "backend_env_tables",
    "c_compiler",
    "check_all",
    "cpu_fused_cache_dir",
    "cpu_fused_mode",
    "cuda_visible_devices",
    "cute_dsl_arch",
    "cutedsl_cache_dir",
    "debug",
    "home_dir",
    "local_rank",
    "master_addr_port",
    "nvshmem_symmetric_size",
    "raw_value",
    "read_env",
    "single_gpu_gloo",
    "timeout_s",
    "torchelastic_agent_store",
    "torchrun_rank",
    "torchrun_rank_and_world_size",
    "torchrun_world_size",
    "tuning_cache_dir",
    "zero_one",
]

DEFAULT_TIMEOUT_S = 120.0
"""Bound on every collective wait when neither `timeout_s=` nor MOE_EP_TIMEOUT_S is given."""

MAX_TIMEOUT_S = 7 * 86400.0
"""Largest accepted timeout (one week): a bound, not "never"; far below what the waits'
timedelta / millisecond clocks can hold (1e15 s overflows `datetime.timedelta`)."""

MAX_RANK = 2**31 - 1
"""torch.distributed holds ranks and world sizes in C ints."""


@dataclass(frozen=True)
class EnvVar:
    """One environment variable moe-ep reads: its name, accepted values and meaning."""

    name: str
    values: str
    meaning: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(
        "LOCAL_RANK",
        f"integer 0..{MAX_RANK}",
        "CUDA device ordinal of this rank when `BootstrapConfig.device` is not given "
        "(set by torchrun). Hosts that pass `device=` never need it.",
    ),
    EnvVar(
        "MEGA_SINGLE_GPU_GLOO",
        "0 or 1 (default 0)",
        "1: several ranks share one GPU; the resolved ordinal is folded `% device_count` "
        "and the process group uses gloo instead of NCCL.",
    ),
    EnvVar(
        "MOE_EP_TIMEOUT_S",
        f"number > 0, at most {MAX_TIMEOUT_S:g} (one week; default {DEFAULT_TIMEOUT_S:g})",
        "Seconds every bootstrap / barrier / teardown wait may take when "
        "`BootstrapConfig.timeout_s` is not given.",
    ),
    EnvVar(
        "MASTER_ADDR, MASTER_PORT",
        "host name; port 1..65535",
        "torchrun rendezvous: when both are set and no `init_method=` is given, moe-ep "
        "initialises torch.distributed with env://.",
    ),
    EnvVar(
        "RANK, WORLD_SIZE",
        f"integers, 0 <= RANK < WORLD_SIZE <= {MAX_RANK}; set both or neither",
        "torchrun's global rank and world size; when set they must agree with "
        "`BootstrapConfig.rank` / `world_size` if moe-ep initialises torch.distributed. "
        "`moe-ep run` runs in-process under torchrun when they are set (then MASTER_ADDR / "
        "MASTER_PORT must be set too).",
    ),
    EnvVar(
        "TORCHELASTIC_USE_AGENT_STORE",
        "True or False (set by torchrun)",
        "True: torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT; moe-ep joins it "
        "as a client instead of hosting one on rank 0.",
    ),
    EnvVar(
        "CUDA_VISIBLE_DEVICES",
        "(read only for messages)",
        "Named in the error when a resolved ordinal is outside the visible devices.",
    ),
    EnvVar(
        "MOE_EP_CPU_FUSED",
        "auto, 0 or 1 (default auto)",
        "The portable kernels' fused CPU epilogues (SwiGLU, top-k combine; a small C library "
        "built on first use): auto uses them when a C compiler works (else eager, with one "
        "warning), 1 requires them (construction fails otherwise), 0 keeps the eager code "
        "(and splits each expert GEMM over the intra-op threads instead of spreading "
        "one-thread expert blocks over them).",
    ),
    EnvVar(
        "MOE_EP_CPU_FUSED_CACHE",
        "absolute directory (default $HOME/.cache/moe-ep/cpu_fused)",
        "Where the fused CPU epilogue library is built, one subdirectory per digest of "
        "source, compiler, flags and CPU features. A relative path is refused; the same "
        "trust rules as MOE_EP_PUSH_CACHE (a refused cache leaves the eager code, with a "
        "warning, unless MOE_EP_CPU_FUSED=1).",
    ),
    EnvVar(
        "MOE_EP_CUTEDSL_CACHE",
        "absolute directory (unset: no cache)",
        "Where the CuTe DSL compile-only checks keep compiled kernels across processes (one "
        "entry per kernel, drop, arch, config, geometry, versions and our sources; "
        "docs/runtime.md, Kernel cache), on the trust rules of MOE_EP_PUSH_CACHE. Unset: "
        "every check compiles. Launches do not use it yet.",
    ),
    EnvVar(
        "MOE_EP_TUNING_CACHE",
        "absolute directory (default $HOME/.cache/moe-ep/tuning)",
        "Where `moe-ep tune` writes its winners (`tuning.json`) and where layers built from a "
        "kernel name read them at construction; a relative path is refused; a corrupted or "
        "stale entry is reported and ignored (docs/performance.md, Tuning cache).",
    ),
    EnvVar(
        "HOME",
        "absolute path of an existing directory",
        "Base of the caches' defaults ($HOME/.cache/moe-ep/...), read only when "
        "MOE_EP_CPU_FUSED_CACHE / MOE_EP_PUSH_CACHE / MOE_EP_TUNING_CACHE is unset; unset, "
        "empty, relative or missing makes that cache unavailable, naming HOME.",
    ),
    EnvVar(
        "NVSHMEM_SYMMETRIC_SIZE",
        "bytes > 0, optional k/m/g/t suffix (NVSHMEM's default 1g)",
        "NVSHMEM's symmetric heap per PE, read by NVSHMEM at initialisation; moe-ep reads it "
        "only to refuse, before allocating, CuTe DSL workspaces that would not fit.",
    ),
    EnvVar(
        "CUTE_DSL_ARCH",
        "CuTe DSL arch, e.g. sm_90a / sm_100a",
        "Read by the CuTe DSL when cutlass is imported; the compile-only checks require it "
        "to equal their `--arch`.",
    ),
    EnvVar(
        "CC",
        "C compiler command or path (default: the first of cc, gcc, clang on PATH)",
        "The compiler that builds the fused CPU epilogue library; when set, only it is tried.",
    ),
    EnvVar(
        "MOE_EP_DEBUG",
        "0 or 1 (default 0)",
        "1: `moe-ep` prints the traceback of a failure (and the ranks' tracebacks) above its "
        "one-line error, as `moe-ep --debug` does.",
    ),
)


def read_env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    """`env`, or `os.environ` when it is None."""
    return os.environ if env is None else env


def raw_value(env: Mapping[str, str] | None, name: str) -> str | None:
    """The value of `name` (None when unset or empty)."""
    value = read_env(env).get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _int(
    env: Mapping[str, str] | None, name: str, *, minimum: int, maximum: int = MAX_RANK
) -> int | None:
    raw = raw_value(env, name)
    if raw is None:
        return None
    try:
        value = int(raw, 10)
    except ValueError:
        value = None
    if value is None or not minimum <= value <= maximum:
        raise MoeEpUsageError(
            f"environment variable {name} must be an integer in {minimum}..{maximum}, "
            f"got {raw!r} (example: {name}={minimum})"
        )
    return value


def zero_one(raw: str | None, name: str) -> bool:
    """A 0 / 1 switch: True for "1", False for "0" or unset; anything else is an error."""
    if raw is None or raw == "0":
        return False
    if raw == "1":
        return True
    raise MoeEpUsageError(f"environment variable {name} must be 0 or 1, got {raw!r}")


def local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """LOCAL_RANK as an int >= 0, None when unset."""
    return _int(env, "LOCAL_RANK", minimum=0)


def torchrun_rank(env: Mapping[str, str] | None = None) -> int | None:
    """RANK as an int >= 0, None when unset."""
    return _int(env, "RANK", minimum=0)


def torchrun_world_size(env: Mapping[str, str] | None = None) -> int | None:
    """WORLD_SIZE as an int >= 1, None when unset."""
    return _int(env, "WORLD_SIZE", minimum=1)


def torchrun_rank_and_world_size(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) when both are set, None when neither is.

    One without the other, or RANK >= WORLD_SIZE, is an error.
    """
    rank, world = torchrun_rank(env), torchrun_world_size(env)
    if rank is None and world is None:
        return None
    if rank is None or world is None:
        missing = "RANK" if rank is None else "WORLD_SIZE"
        raise MoeEpUsageError(
            f"environment variables RANK and WORLD_SIZE must be set together; {missing} is "
            f"unset (RANK={rank!r}, WORLD_SIZE={world!r})"
        )
    if rank >= world:
        raise MoeEpUsageError(
            f"environment variable RANK must be < WORLD_SIZE, got RANK={rank}, WORLD_SIZE={world}"
        )
    return rank, world


def single_gpu_gloo(env: Mapping[str, str] | None = None) -> bool:
    """MEGA_SINGLE_GPU_GLOO: True for "1", False for "0" or unset; anything else is an error."""
    return zero_one(raw_value(env, "MEGA_SINGLE_GPU_GLOO"), "MEGA_SINGLE_GPU_GLOO")


def torchelastic_agent_store(env: Mapping[str, str] | None = None) -> bool:
    """TORCHELASTIC_USE_AGENT_STORE: True for "True" (torch's own spelling), False for
    "False" or unset; anything else is an error."""
    raw = raw_value(env, "TORCHELASTIC_USE_AGENT_STORE")
    if raw is None or raw == "False":
        return False
    if raw == "True":
        return True
    raise MoeEpUsageError(
        f"environment variable TORCHELASTIC_USE_AGENT_STORE must be True or False, got {raw!r}"
    )


def timeout_s(env: Mapping[str, str] | None = None) -> float | None:
    """MOE_EP_TIMEOUT_S as a float in (0, `MAX_TIMEOUT_S`], None when unset."""
    raw = raw_value(env, "MOE_EP_TIMEOUT_S")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN fails too
        raise MoeEpUsageError(
            f"environment variable MOE_EP_TIMEOUT_S must be a number of seconds > 0 and "
            f"<= {MAX_TIMEOUT_S:g} (one week), got {raw!r} (example: MOE_EP_TIMEOUT_S=30)"
        )
    return value


def master_addr_port(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(MASTER_ADDR, MASTER_PORT) when both are set, None when neither is.

    One without the other, or a port outside 1..65535, is an error.
    """
    addr = raw_value(env, "MASTER_ADDR")
    port = _int(env, "MASTER_PORT", minimum=1, maximum=65535)
    if addr is None and port is None:
        return None
    if addr is None or port is None:
        missing = "MASTER_ADDR" if addr is None else "MASTER_PORT"
        raise MoeEpUsageError(
            f"environment variables MASTER_ADDR and MASTER_PORT must be set together; "
            f"{missing} is unset (MASTER_ADDR={addr!r}, MASTER_PORT={port!r})"
        )
    return addr, port


def cuda_visible_devices(env: Mapping[str, str] | None = None) -> str:
    """CUDA_VISIBLE_DEVICES as written, or "(unset)"; only used in messages."""
    value = read_env(env).get("CUDA_VISIBLE_DEVICES")
    return "(unset)" if value is None else repr(value)


def absolute_dir(env: Mapping[str, str] | None, name: str) -> str | None:
    """`name` as written when it is an absolute path, None when unset or empty."""
    value = read_env(env).get(name) or None
    if value is not None and not os.path.isabs(value):
        raise MoeEpUsageError(
            f"environment variable {name} must be an absolute directory path, got {value!r} "
            f"(example: {name}=/var/tmp/moe-ep-cache)"
        )
    return value


def cpu_fused_mode(env: Mapping[str, str] | None = None) -> str:
    """MOE_EP_CPU_FUSED: "auto" (unset or empty), "0" or "1"; anything else is an error."""
    raw = raw_value(env, "MOE_EP_CPU_FUSED")
    if raw is None:
        return "auto"
    if raw not in ("auto", "0", "1"):
        raise MoeEpUsageError(
            f"environment variable MOE_EP_CPU_FUSED must be auto, 0 or 1, got {raw!r}"
        )
    return raw


def cpu_fused_cache_dir(env: Mapping[str, str] | None = None) -> str | None:
    """MOE_EP_CPU_FUSED_CACHE as written (it must be absolute), None when unset or empty."""
    return absolute_dir(env, "MOE_EP_CPU_FUSED_CACHE")


def cutedsl_cache_dir(env: Mapping[str, str] | None = None) -> str | None:
    """MOE_EP_CUTEDSL_CACHE as written (it must be absolute), None when unset or empty."""
    return absolute_dir(env, "MOE_EP_CUTEDSL_CACHE")


def tuning_cache_dir(env: Mapping[str, str] | None = None) -> str | None:
    """MOE_EP_TUNING_CACHE as written (it must be absolute), None when unset or empty."""
    return absolute_dir(env, "MOE_EP_TUNING_CACHE")


def home_dir(env: Mapping[str, str] | None = None) -> str | None:
    """HOME as written, None when unset or empty; `moe_ep.cache_trust` checks it where the
    caches' defaults need it (nowhere else, so check_all accepts any value)."""
    return read_env(env).get("HOME") or None


def cute_dsl_arch(env: Mapping[str, str] | None = None) -> str | None:
    """CUTE_DSL_ARCH exactly as written (the CuTe DSL reads it itself), None when unset."""
    return read_env(env).get("CUTE_DSL_ARCH")


def c_compiler(env: Mapping[str, str] | None = None) -> str | None:
    """CC as written (a command or a path), None when unset or empty."""
    return raw_value(env, "CC")


def debug(env: Mapping[str, str] | None = None) -> bool:
    """MOE_EP_DEBUG: True for "1", False for "0" or unset; anything else is an error."""
    return zero_one(raw_value(env, "MOE_EP_DEBUG"), "MOE_EP_DEBUG")


NVSHMEM_DEFAULT_HEAP = 1 << 30
_SIZE_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_MAX_SIZE = float(2**63 - 1024)  # the largest double below 2**63


def nvshmem_symmetric_size(env: Mapping[str, str] | None = None) -> int:
    """NVSHMEM_SYMMETRIC_SIZE in bytes as NVSHMEM reads it (a number, optionally fractional,
    with one k/m/g/t suffix in either case; "20m" = 20 MiB); `NVSHMEM_DEFAULT_HEAP` (1 GiB)
    when unset."""
    raw = raw_value(env, "NVSHMEM_SYMMETRIC_SIZE")
    if raw is None:
        return NVSHMEM_DEFAULT_HEAP
    # NVSHMEM: "only one multiplier is recognized and any characters following it are
    # ignored" ("20kk" is 20 KiB)
    m = re.match(r"(\d*\.?\d+(?:[eE][-+]?\d+)?)([kKmMgGtT]?)", raw)
    size = float(m.group(1)) * _SIZE_SUFFIX[m.group(2).lower()] if m else math.nan
    if not 0 < size <= _MAX_SIZE:  # NaN fails too
        raise MoeEpUsageError(
            "environment variable NVSHMEM_SYMMETRIC_SIZE must be a size in bytes > 0 and "
            f"< 2**63 with an optional k/m/g/t suffix, got {raw!r} "
            "(example: NVSHMEM_SYMMETRIC_SIZE=4g)"
        )
    return math.ceil(size)


_CHECKS: dict[str, Callable[[Mapping[str, str] | None], object]] = {
    "LOCAL_RANK": local_rank,
    "MEGA_SINGLE_GPU_GLOO": single_gpu_gloo,
    "MOE_EP_TIMEOUT_S": timeout_s,
    "MASTER_ADDR, MASTER_PORT": master_addr_port,
    "RANK, WORLD_SIZE": torchrun_rank_and_world_size,
    "TORCHELASTIC_USE_AGENT_STORE": torchelastic_agent_store,
    "CUDA_VISIBLE_DEVICES": cuda_visible_devices,
    "MOE_EP_CPU_FUSED": cpu_fused_mode,
    "MOE_EP_CPU_FUSED_CACHE": cpu_fused_cache_dir,
    "MOE_EP_CUTEDSL_CACHE": cutedsl_cache_dir,
    "MOE_EP_TUNING_CACHE": tuning_cache_dir,
    "HOME": home_dir,
    "NVSHMEM_SYMMETRIC_SIZE": nvshmem_symmetric_size,
    "CUTE_DSL_ARCH": cute_dsl_arch,
    "CC": c_compiler,
    "MOE_EP_DEBUG": debug,
}
"""The reader of each `ENV_VARS` entry (by its name), for `check_all`."""


ENV_ENTRY_POINT_GROUP = "moe_ep.env"
"""Entry-point group of the backend packages' env modules (`ENV_VARS`, `CHECKS`)."""


def backend_env_tables() -> list[tuple[tuple[EnvVar, ...], Mapping[str, Callable[..., object]]]]:
    """(ENV_VARS, CHECKS) of every installed backend package's env module, by entry name.

    A backend whose env module cannot be imported is left out (its kernels are listed
    unavailable with the import error by the registry)."""
    import importlib.metadata

    tables: list[tuple[tuple[EnvVar, ...], Mapping[str, Callable[..., object]]]] = []
    eps = importlib.metadata.entry_points(group=ENV_ENTRY_POINT_GROUP)
    for ep in sorted(eps, key=lambda ep: ep.name):
        try:
            module = ep.load()
        except Exception:
            continue
        tables.append((tuple(module.ENV_VARS), dict(module.CHECKS)))
    return tables


def all_env_vars() -> tuple[EnvVar, ...]:
    """Core's `ENV_VARS`, then each installed backend package's."""
    return ENV_VARS + tuple(var for table, _ in backend_env_tables() for var in table)


def check_all(env: Mapping[str, str] | None = None) -> None:
    """Parse every variable of `all_env_vars()` with its reader.

    Raises:
        MoeEpUsageError: one message naming every malformed variable with its rule.
    """
    checks = [(var, _CHECKS[var.name]) for var in ENV_VARS]
    for table, readers in backend_env_tables():
        checks += [(var, readers[var.name]) for var in table]
    errors = []
    for _, check in checks:
        try:
            check(env)
        except MoeEpUsageError as exc:
            errors.append(str(exc))
    if errors:
        raise MoeEpUsageError("; ".join(errors))

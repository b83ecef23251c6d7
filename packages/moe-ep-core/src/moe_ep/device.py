"""Device resolution: the one function every bind site uses.

The CUDA `set_device`, `torch.distributed.init_process_group(device_id=...)` under NCCL and
NVSHMEM init all take their ordinal from `resolve_local_device`, so they can never disagree.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from moe_ep import env as _env
from moe_ep.config import BootstrapConfig
from moe_ep.errors import MoeEpUsageError

__all__ = [
    "DeviceResolution",
    "describe_device_resolution",
    "resolve_device_detailed",
    "resolve_local_device",
    "usable_cpus",
    "warn_if_host_bound_elsewhere",
]


@dataclass(frozen=True)
class DeviceResolution:
    """The outcome of device resolution and where the number came from."""

    ordinal: int | None
    """CUDA ordinal to bind, None = CPU (no visible CUDA device)."""
    source: str
    """Where the number came from, e.g. "LOCAL_RANK=3" or "BootstrapConfig.device=1"."""
    device_count: int
    folded: bool
    """True when MEGA_SINGLE_GPU_GLOO=1 folded the ordinal `% device_count`."""


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask; `os.cpu_count()` where the
    platform has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _torch_device_count() -> int:
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def resolve_device_detailed(
    config: BootstrapConfig,
    *,
    env: Mapping[str, str] | None = None,
    device_count: int | None = None,
) -> DeviceResolution:
    """Like `resolve_local_device`, also saying where the ordinal came from."""
    if not isinstance(config, BootstrapConfig):
        raise MoeEpUsageError(
            f"config must be a BootstrapConfig, got {config!r} ({type(config).__name__})"
        )
    if device_count is None:
        device_count = _torch_device_count()
    elif isinstance(device_count, bool) or not isinstance(device_count, int) or device_count < 0:
        raise MoeEpUsageError(f"device_count must be an int >= 0, got {device_count!r}")
    # Explicit arguments win: LOCAL_RANK is not even parsed when `device` is given.
    if config.device is not None:
        ordinal, source = config.device, f"BootstrapConfig.device={config.device}"
    else:
        local = _env.local_rank(env)
        if local is not None:
            ordinal, source = local, f"LOCAL_RANK={local}"
        else:
            ordinal, source = config.rank, f"BootstrapConfig.rank={config.rank} (LOCAL_RANK unset)"
    fold = _env.single_gpu_gloo(env)
    if device_count == 0:
        return DeviceResolution(None, source, 0, False)
    if fold:
        return DeviceResolution(ordinal % device_count, source, device_count, True)
    if ordinal >= device_count:
        raise MoeEpUsageError(
            f"CUDA device ordinal {ordinal} (from {source}) is outside the {device_count} "
            f"visible CUDA device(s) (CUDA_VISIBLE_DEVICES={_env.cuda_visible_devices(env)}); "
            "pass BootstrapConfig(device=...) explicitly, fix LOCAL_RANK / CUDA_VISIBLE_DEVICES, "
            "or set MEGA_SINGLE_GPU_GLOO=1 if several ranks share one GPU"
        )
    return DeviceResolution(ordinal, source, device_count, False)


def resolve_local_device(
    config: BootstrapConfig,
    *,
    env: Mapping[str, str] | None = None,
    device_count: int | None = None,
) -> int | None:
    """CUDA ordinal this rank binds, or None where there is no CUDA device.

    Precedence: `config.device`, else `LOCAL_RANK`, else `config.rank`. Only when
    `MEGA_SINGLE_GPU_GLOO=1` (several ranks share a GPU) is the result folded
    `% device_count`; otherwise an ordinal `>= device_count` is an error.

    Args:
        config: the rank's bootstrap config.
        env: environment to read (default `os.environ`).
        device_count: visible CUDA devices (default what torch sees; 0 = CPU only).

    Returns:
        The ordinal, or None when `device_count == 0` (run on CPU).

    Raises:
        MoeEpUsageError: malformed LOCAL_RANK / MEGA_SINGLE_GPU_GLOO, or an ordinal outside
            the visible devices (the message names its source and CUDA_VISIBLE_DEVICES).
    """
    return resolve_device_detailed(config, env=env, device_count=device_count).ordinal


_warned_lock = threading.Lock()
_warned = False


def warn_if_host_bound_elsewhere(
    config: BootstrapConfig, resolved: DeviceResolution, current_device: int | None
) -> bool:
    """Warn (once per process) when the host already bound another CUDA device.

    Only when no explicit `device` was given: the host's binding and LOCAL_RANK/rank then
    disagree, which usually means a vLLM-style host should pass
    `device=torch.cuda.current_device()`. Returns True if it warned now.
    """
    global _warned
    if config.device is not None or current_device is None or resolved.ordinal is None:
        return False
    if current_device == resolved.ordinal:
        return False
    with _warned_lock:
        if _warned:
            return False
        _warned = True
    warnings.warn(
        f"moe-ep binds cuda:{resolved.ordinal} (from {resolved.source}) but the host already "
        f"made cuda:{current_device} the current device; pass "
        "BootstrapConfig(device=torch.cuda.current_device()) to keep the host's choice",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def describe_device_resolution(env: Mapping[str, str] | None = None) -> str:
    """One line for `moe-ep info`: what a default config for this process would bind."""
    try:
        rank = _env.torchrun_rank(env) or 0
        world = max(_env.torchrun_world_size(env) or 1, rank + 1)
        res = resolve_device_detailed(BootstrapConfig(world, rank), env=env)
    except MoeEpUsageError as exc:
        return f"error: {exc}"
    if res.ordinal is None:
        return "cpu (no CUDA device visible)"
    fold = f", folded % {res.device_count} by MEGA_SINGLE_GPU_GLOO=1" if res.folded else ""
    return (
        f"cuda:{res.ordinal} (from {res.source}{fold}; {res.device_count} visible, "
        f"CUDA_VISIBLE_DEVICES={_env.cuda_visible_devices(env)})"
    )

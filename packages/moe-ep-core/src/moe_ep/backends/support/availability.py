"""Why a GPU backend's kernel can or cannot run here: GPU arch, packages, tools, drops.

Nothing here imports cutlass, nvshmem or a drop's kernel sources; package presence is
checked with `importlib.util.find_spec` and the drop through its package `__init__`
(`drop_access.DropRef.reason`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shutil

from moe_ep.backends.support.drop_access import DropRef

__all__ = [
    "check_availability",
    "cuda_capability_reason",
    "missing_packages",
    "nvcc_reason",
    "outdated_packages",
]


def cuda_capability_reason(required: tuple[int, int], label: str) -> str:
    """ "" if the current CUDA device has exactly compute capability `required`, else why not.

    The kernels are built for arch-specific targets (`sm_90a`, `sm_100a`), which run only on
    that exact capability.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    device = torch.cuda.current_device()
    cap = tuple(torch.cuda.get_device_capability(device))
    if cap != required:
        name = torch.cuda.get_device_name(device)
        return (
            f"cuda:{device} ({name}) has compute capability {cap[0]}.{cap[1]}; this kernel "
            f"needs {required[0]}.{required[1]} ({label})"
        )
    return ""


def missing_packages(modules: tuple[tuple[str, str], ...]) -> list[str]:
    """For each `(import_name, pip_name)` that cannot be found, a "pip_name missing" phrase."""
    out = []
    for import_name, pip_name in modules:
        try:
            found = importlib.util.find_spec(import_name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(f"python package {pip_name!r} (import {import_name}) is not installed")
    return out


def _release(version: str) -> tuple[int, ...]:
    """The leading release numbers of a version string (`4.8.1.post2` -> (4, 8, 1))."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in m.group().split(".")) if m else ()


def outdated_packages(floors: tuple[tuple[str, str, str], ...]) -> list[str]:
    """For each `(distribution, minimum, why)` installed at a release below `minimum`, a
    phrase naming both versions and `why` (a distribution not installed is left to
    `missing_packages`)."""
    out = []
    for dist, minimum, why in floors:
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        if _release(have) < _release(minimum):
            out.append(f"python package {dist!r} is {have}; {why} needs >= {minimum}")
    return out


def nvcc_reason(purpose: str) -> str:
    """ "" if `nvcc` is on PATH, else why it is needed (`purpose`) and missing."""
    if shutil.which("nvcc") is None:
        return f"nvcc is not on PATH ({purpose})"
    return ""


def check_availability(
    *,
    capability: tuple[int, int],
    arch_label: str,
    packages: tuple[tuple[str, str], ...] = (),
    floors: tuple[tuple[str, str, str], ...] = (),
    drop: DropRef | None = None,
) -> tuple[bool, str]:
    """(True, "") or (False, every reason joined by "; ") for one kernel on this machine.

    `floors`: `(distribution, minimum version, who needs it)` (`outdated_packages`)."""
    reasons = missing_packages(packages) + outdated_packages(floors)
    if drop is not None:
        why = drop.reason()
        if why:
            reasons.append(why)
    why = cuda_capability_reason(capability, arch_label)
    if why:
        reasons.append(why)
    return (not reasons, "; ".join(reasons))

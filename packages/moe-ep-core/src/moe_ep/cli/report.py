"""`moe-ep info` and `moe-ep kernels`: what this machine has and which kernels can run."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform

from rich.console import Console
from rich.table import Table

from moe_ep.registry import KernelInfo, available_kernels

__all__ = ["environment_report", "kernel_table", "print_info", "print_kernels"]


def environment_report() -> dict[str, str]:
    """Facts about this machine as label -> value (strings), for `info` and `demo`."""
    import torch
    import torch.distributed as dist

    from moe_ep.backends.portable import cpu_fused
    from moe_ep.device import describe_device_resolution

    cuda = torch.cuda.is_available()
    devices = "none"
    if cuda:
        devices = ", ".join(
            f"{i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor})"
            for i in range(torch.cuda.device_count())
            for major, minor in [torch.cuda.get_device_capability(i)]
        )
    backends = [
        name
        for name, ok in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if ok
    ]
    installed = []
    for dist_name in ("moe-ep-core", "moe-ep-backends-sm90", "moe-ep-backends-sm100"):
        try:
            installed.append(f"{dist_name} {importlib.metadata.version(dist_name)}")
        except importlib.metadata.PackageNotFoundError:
            installed.append(f"{dist_name} (not installed)")
    fused, fused_why = cpu_fused.status()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch CUDA build": str(torch.version.cuda),
        "CUDA available": str(cuda),
        "devices": devices,
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
        "dist backends": ", ".join(backends) or "none",
        "moe-ep packages": "; ".join(installed),
        "resolved device": describe_device_resolution(),
        "fused CPU epilogues": f"{'in use' if fused else 'not in use'} ({fused_why})",
        "CPU expert GEMM": _cpu_expert_gemm() if fused else "not available (no fused CPU library)",
        "tuning cache": _tuning_cache(),
    }


def _cpu_expert_gemm() -> str:
    """The expert GEMM's vector bodies on this CPU (`expert_gemm`'s `vector` names) and what
    `cpu_prepacked_weights` does."""
    import torch

    from moe_ep.backends.portable import cpu_fused, experts

    names = ", ".join(cpu_fused.runnable_bodies()) or "the scalar twins only"
    cpu = torch.device("cpu")
    layout = experts.prepack_layout(cpu)
    if layout == "k16":
        packed = (
            "packs the expert weights for the expert GEMM's k order in place of the layer's "
            "own: in bf16 (bf16, and the quantized formats whose values are exact in bf16), "
            "fp8's as their e4m3 codes and scales (faster decode; the default for the "
            "quantized formats: 0.2-0.44x their memory; docs/layer.md)"
        )
    elif layout == "onednn":
        packed = "keeps a second copy of the bf16 expert weights in oneDNN's blocked layout"
    else:
        packed = f"refused ({experts.prepack_host_unavailable(cpu)})"
    return f"{names}; cpu_prepacked_weights=True {packed}"


def _tuning_cache() -> str:
    """Where `moe-ep tune` writes and layers read (MOE_EP_TUNING_CACHE), and its entries."""
    from moe_ep.tuning import TuningCache, cache_path

    path = cache_path()
    if not path.is_file():
        return f"{path} (none yet)"
    return f"{path} ({TuningCache(path).count()} entries)"


def print_info(console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title="moe-ep environment", show_header=False)
    for key, value in environment_report().items():
        table.add_row(key, value)
    console.print(table)


def kernel_table(infos: list[KernelInfo]) -> Table:
    """One row per canonical kernel; the reasons of unavailable ones go below the table."""
    table = Table(title="moe-ep kernels")
    # Names never wrap or truncate: they are what users copy into --kernel.
    width = max((len(info.name) for info in infos), default=6)
    table.add_column("kernel", no_wrap=True, min_width=width)
    table.add_column("available", no_wrap=True)
    table.add_column("deprecated aliases")
    table.add_column("from")
    for info in infos:
        table.add_row(
            info.name,
            "yes" if info.available else "no (see below)",
            ", ".join(info.deprecated_aliases),
            info.source,
        )
    return table


def print_kernels(*, as_json: bool, console: Console | None = None) -> None:
    if as_json:
        print(json.dumps([info.to_json() for info in available_kernels()], indent=2))
        return
    console = console or Console()
    infos = available_kernels()
    console.print(kernel_table(infos))
    for info in infos:
        if not info.available:
            console.print(f"[bold]{info.name}[/bold]: {info.reason}", highlight=False)

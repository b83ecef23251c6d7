"""Kernel registry: taxonomy names, deprecated aliases, entry-point discovery, availability."""

from moe_ep.registry.registry import (
    KernelInfo,
    Registry,
    available_kernels,
    default_registry,
    get_kernel,
    register_mega_kernel,
    resolve_kernel_name,
)
from moe_ep.registry.taxonomy import KernelName, parse_kernel_name

__all__ = [
    "KernelInfo",
    "KernelName",
    "Registry",
    "available_kernels",
    "default_registry",
    "get_kernel",
    "parse_kernel_name",
    "register_mega_kernel",
    "resolve_kernel_name",
]

"""`moe-ep demo` and `moe-ep run` (placeholder until the portable layer lands)."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["add_parsers", "run_command"]


def add_parsers(sub: Any) -> None:
    sub.add_parser("demo", help="run every portable format against the oracle")


def run_command(args: argparse.Namespace) -> int:
    from moe_ep.cli.report import print_info, print_kernels

    print_info()
    print_kernels(as_json=False)
    return 0

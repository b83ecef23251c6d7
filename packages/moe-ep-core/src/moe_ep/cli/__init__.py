"""The `moe-ep` command line: `info`, `kernels`, `demo`, `run`.

Usage:
  moe-ep info                 torch, CUDA, devices, dist backends, backends, resolved device
  moe-ep kernels [--json]     every canonical kernel with availability on this machine
  moe-ep demo                 every portable format (+ the best GPU kernel) vs the oracle
  moe-ep run --kernel NAME .. one kernel on any shape, optionally checked (`run --help`)

Exit codes: 0 success; 1 a check failed; 2 usage error; 3 unavailable on this machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError

__all__ = ["main"]

EXIT_OK, EXIT_CHECK_FAILED, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-ep",
        description="Mixture-of-Experts expert-parallel runtime.",
        epilog="Exit codes: 0 ok, 1 check failed, 2 usage error, 3 unavailable here.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("info", help="environment report")
    kernels = sub.add_parser("kernels", help="list kernels and their availability")
    kernels.add_argument("--json", action="store_true", help="print a JSON list")
    from moe_ep.cli import jobs

    jobs.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `moe-ep`; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "info":
            from moe_ep.cli.report import print_info

            print_info()
            return EXIT_OK
        if args.command == "kernels":
            from moe_ep.cli.report import print_kernels

            print_kernels(as_json=args.json)
            return EXIT_OK
        from moe_ep.cli import jobs

        return jobs.run_command(args)
    except MoeEpUsageError as exc:
        print(f"moe-ep: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MoeEpUnavailableError as exc:
        print(f"moe-ep: unavailable: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())

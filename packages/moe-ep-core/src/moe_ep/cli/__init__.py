"""The `moe-ep` command line: `info`, `kernels`, `demo`, `run`, `bench`, `tune`, `smoke` (also
`python -m moe_ep.cli`).

Usage:
  moe-ep [--debug] info       torch, CUDA, devices, dist backends, backends, resolved device
  moe-ep kernels [--json]     every canonical kernel with availability on this machine
  moe-ep demo                 every portable format (+ the best GPU kernel) vs the oracle
  moe-ep run --kernel NAME .. one kernel on any shape, optionally checked (`run --help`)
  moe-ep bench [--quick] ..   the layer vs measured limits and peers (`bench --help`)
  moe-ep tune [--quick] ..    sweep a kernel's knobs, cache the winner (`tune --help`)
  moe-ep smoke --kill-rank R  serving loop, a rank killed, survivors evict (`smoke --help`)

Every failure prints one `moe-ep: error: ...` line (with `--debug` or MOE_EP_DEBUG=1, the
traceback above it) and exits with its kind's code: 0 success; 1 a check failed; 2 usage
error; 3 unavailable on this machine; 4 a rank failed; 5 internal error; 128+N stopped by
signal N (130 SIGINT, 143 SIGTERM). `moe_ep.cli.exits` has the table.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from moe_ep.cli.exits import (
    EXIT_CHECK_FAILED,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_PEER,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    classify,
    raise_on_terminate,
)

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_PEER",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "main",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-ep",
        description="Mixture-of-Experts expert-parallel runtime.",
        epilog="Exit codes: 0 ok, 1 check failed, 2 usage error, 3 unavailable here, 4 a rank "
        "failed, 5 internal error, 128+N stopped by signal N (130 SIGINT, 143 SIGTERM).",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback (and the ranks' tracebacks) of a failure; also MOE_EP_DEBUG=1",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("info", help="environment report; exit 2 if a variable is malformed")
    kernels = sub.add_parser("kernels", help="list kernels and their availability")
    kernels.add_argument("--json", action="store_true", help="print a JSON list")
    from moe_ep.cli import bench, jobs, smoke, tune

    jobs.add_parsers(sub)
    bench.add_parser(sub)
    tune.add_parser(sub)
    smoke.add_parser(sub)
    return parser


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "info":
        from moe_ep import env
        from moe_ep.cli.report import print_info

        env.check_all()
        print_info()
        return EXIT_OK
    if args.command == "kernels":
        from moe_ep.cli.report import print_kernels

        print_kernels(as_json=args.json)
        return EXIT_OK
    if args.command == "bench":
        from moe_ep.cli import bench

        return bench.run(args)
    if args.command == "tune":
        from moe_ep.cli import tune

        return tune.run(args)
    if args.command == "smoke":
        from moe_ep.cli import smoke

        return smoke.run(args)
    from moe_ep.cli import jobs

    return jobs.run_command(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `moe-ep`; returns the exit code (argparse exits 2 itself)."""
    with raise_on_terminate():
        debug = False
        try:
            args = build_parser().parse_args(argv)
            from moe_ep import env

            debug = bool(args.debug) or env.debug()
            return _dispatch(args)
        except SystemExit:
            raise
        except BaseException as exc:
            code, line = classify(exc, debug=debug)
            if debug:
                traceback.print_exception(exc, file=sys.stderr)
            print(f"moe-ep: error: {line}", file=sys.stderr)
            return code

"""`moe-ep bench`: the layer at several shapes, world sizes and routings, for every
available kernel, against limits measured in the same run (`moe_ep.bench`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from moe_ep.cli.exits import EXIT_OK

DEFAULT_PLOT_DIR = Path("benchmarks/out")


def add_parser(sub: Any) -> None:
    """Register `bench` on the `moe-ep` subcommands."""
    p = sub.add_parser(
        "bench",
        help="time the layer against measured limits and peers (table, JSON, plots)",
        description="Time one forward of every available kernel (or --kernel) at each shape, "
        "world size (local ranks) and routing: median of --reps runs after --warmup, tokens/s, "
        "useful TFLOP/s, and ratios to limits measured in the same run (dense GEMMs of the "
        "same FLOPs, the read-bandwidth limit of the active weight bytes, a bare "
        "all_to_all_single of the same bytes, the naive per-expert loop, transformers' experts "
        "from the optional `bench` group). On CUDA runs are timed by CUDA events (never run on "
        "a GPU yet).",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="one small shape per regime (prefill-like, decode-like) at EP 1 and 2, uniform "
        "routing",
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="T,H,I,E,k",
        help="add a shape (tokens per rank, hidden, intermediate, experts, top-k); repeatable",
    )
    p.add_argument(
        "--only-shapes",
        action="store_true",
        help="run only the --shape shapes (not the defaults / --quick ones)",
    )
    p.add_argument(
        "--ep", type=int, nargs="+", default=None, help="world sizes (default 1 2 4; quick: 1 2)"
    )
    p.add_argument(
        "--routing",
        nargs="+",
        default=None,
        help="uniform and / or skewed (about 70%% of tokens to one expert; default both, "
        "quick: uniform)",
    )
    p.add_argument(
        "--kernel", action="append", default=[], help="a kernel to run (default: all available)"
    )
    p.add_argument("--reps", type=int, default=None, help="timed runs each (default 5; quick 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before timing (1)")
    p.add_argument("--no-peers", action="store_true", help="skip transformers' experts")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--plot-dir",
        type=Path,
        default=DEFAULT_PLOT_DIR,
        help=f"where the PNG plots go (default {DEFAULT_PLOT_DIR})",
    )
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds per world size's ranks (1800)"
    )


def request(args: argparse.Namespace) -> Any:
    """The `BenchRequest` of the parsed options (usage errors name the option)."""
    from moe_ep.bench.runner import BenchRequest, available_kernels, kernel_name
    from moe_ep.bench.shapes import QUICK_SHAPES, default_shapes, parse_shape
    from moe_ep.cli.capacity import available_memory_bytes

    extra = tuple(parse_shape(s) for s in args.shape)
    base: tuple[Any, ...] = ()
    if not args.only_shapes:
        base = QUICK_SHAPES if args.quick else default_shapes(available_memory_bytes())
    eps = args.ep if args.ep is not None else ([1, 2] if args.quick else [1, 2, 4])
    reps = args.reps if args.reps is not None else (3 if args.quick else 5)
    routings = args.routing or (["uniform"] if args.quick else ["uniform", "skewed"])
    return BenchRequest(
        shapes=(*base, *extra),
        world_sizes=tuple(eps),
        routings=tuple(dict.fromkeys(routings)),
        kernels=tuple(dict.fromkeys(kernel_name(k) for k in args.kernel)) or available_kernels(),
        reps=reps,
        warmup=args.warmup,
        peers=not args.no_peers,
        timeout_s=args.timeout,
    )


def run(args: argparse.Namespace) -> int:
    """Run the bench, print the table, write the JSON and the plots."""
    import torch

    from moe_ep.bench import report, results
    from moe_ep.bench.machine import this_machine
    from moe_ep.bench.runner import check_request, run_bench
    from moe_ep.bench.tables import console

    req = request(args)
    check_request(req)
    rows, bandwidth = run_bench(req)
    cuda = torch.cuda.is_available()
    machine = this_machine()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    desc = machine.describe() + ("" if not cuda else f", {device}")
    what = (
        f"median of {req.reps} runs after {req.warmup} warm-up; "
        + ("CUDA events" if cuda else "wall time")
        + "; read bandwidth "
        + ", ".join(f"EP{ws} {bw / 1e9:.1f} GB/s/rank" for ws, bw in bandwidth.items())
    )
    out = console(log_width=240)  # fifteen columns
    out.print(report.table(rows, desc, what))
    for line in report.skip_lines(rows):
        out.print(line, highlight=False)
    for why in dict.fromkeys(
        r.notes["peer"] for r in rows if r.world_size == 1 and "peer" in r.notes
    ):
        out.print(f"transformers peer skipped: {why}")
    if args.json is not None:
        doc = results.document(
            rows,
            machine=machine.as_dict(),
            device=device,
            timing="cuda events" if cuda else "wall time",
            reps=req.reps,
            warmup=req.warmup,
            bandwidth=bandwidth,
            command=["moe-ep", *sys.argv[1:]],
        )
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        out.print(f"wrote {args.json}")
    if not args.no_plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            out.print("plots skipped: matplotlib is not installed (it comes with the dev group)")
        else:
            for path in report.plot_families(rows, desc, args.plot_dir):
                out.print(f"wrote {path}")
    return EXIT_OK

#!/usr/bin/env python3
"""Keep vendored kernel drops byte-verbatim and re-diffable against their upstream.

Usage: uv run tools/vendor.py COMMAND [options]      (every command takes --json)

Commands:
  add NAME (--git URL --commit REV | --pypi DIST==VERSION [--artifact FILE] [--sha256 HEX]
           | --path DIR) --subdir DIR --description TEXT --license SPDX [--consumer NAME]...
      First import: fetch, write vendor/NAME/{src/,vendor.lock.json,VENDOR.md,pyproject.toml,
      hatch_build.py,shim/}.
  sync (NAME... | --all) [--to REV [--sha256 HEX]] [--force]
      Materialize src/ from the pin (staged, then swapped in atomically with the lock and
      VENDOR.md; skipped when src/ already matches the lock).
      Refuses to overwrite local edits without --force (bytes equal to a lock of the drop's
      git history are no edits: a pull or merge that re-pinned it). --to re-pins (git commit
      or ref, PyPI version, or directory) and drops the [[pending]] entries the new pin
      already contains.
  verify (NAME... | --all | --present)
      Offline: every byte and mode matches vendor.lock.json, nothing missing or extra, the lock
      matches the VENDOR.md pin, pending patches reproduce, license files present, no
      shim/*/_upstream/ in the checkout. --present checks only the drops whose src/ is
      materialized (the pre-commit guard).
  diff NAME [--against REV | --head]
      Unified diff, limited to the drop's subdir, from the pin (or REV, or upstream head) to
      src/, then a summary. Exit 1 when they differ.
  outdated (NAME... | --all)
      Is upstream (git ref, newest PyPI release) ahead of the pin, and for which files.
  status
      One table over all drops: pin, age, pending, materialized, verified.
  pull-file NAME PATH --rev REV --reason TEXT
      Take one file (PATH relative to src/) from a newer upstream revision; record it as a
      [[pending]] entry with from/to revision and sha256 and a patch under patches/.
  lint (NAME... | --all)       Metadata and member layout checks (hatch_build.py and the shim
                               exactly as tools/vendorlib/templates.py generates them).
  licenses (NAME... | --all)   Declared SPDX license vs license files and SPDX file headers.

Options for every command: --json (machine output on stdout), --quiet (no progress bars),
--root DIR (repository root; default: the one holding this tool).

Exit codes: 0 all holds; 1 a check found a mismatch (verify, lint, licenses, diff, refused
sync) or upstream is ahead (outdated); 2 usage error (bad arguments, unknown drop, malformed
VENDOR.md or lock where a command needs them; verify and lint report those as exit 1);
3 the source cannot be reached, lacks the revision or subdir, or fails its sha256.

Environment: MOE_EP_VENDOR_CACHE (artifact and git-mirror cache; default
~/.cache/moe-ep-vendor), MOE_EP_VENDOR_INDEX_URL (PyPI simple index; default
https://pypi.org/simple). See docs/vendoring.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vendorlib import checks, ops
from vendorlib.drops import default_root, drop_names, select_drops
from vendorlib.errors import EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, UsageError, VendorError
from vendorlib.meta import Pin
from vendorlib.progress import make_progress
from vendorlib.sources import complete_pin


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse's own exit is 2 as well; keep one path
        raise UsageError(f"{self.prog}: {message}")


def _parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument("--quiet", action="store_true", help="no progress bars")
    common.add_argument("--root", type=Path, default=None, help="repository root")
    p = _Parser(
        prog="vendor.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    a = sub.add_parser("add", parents=[common], help="first import of a drop")
    a.add_argument("name")
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--git", metavar="URL")
    src.add_argument("--pypi", metavar="DIST==VERSION")
    src.add_argument("--path", metavar="DIR")
    a.add_argument("--commit", default="HEAD", help="git commit or ref (resolved to a full sha)")
    a.add_argument("--artifact", help="PyPI artifact file name (default: the version's wheel)")
    a.add_argument("--sha256", help="PyPI artifact sha256 (default: the index's)")
    a.add_argument("--subdir", required=True)
    a.add_argument("--description", required=True)
    a.add_argument("--license", required=True, dest="spdx", metavar="SPDX")
    a.add_argument("--license-file", action="append", default=[], help="license file in src/")
    a.add_argument("--consumer", action="append", default=[], help="kernel name using the drop")
    a.add_argument("--include", action="append", default=None)
    a.add_argument("--exclude", action="append", default=[])
    a.add_argument("--package", help="shim import package (default moe_ep_drop_NAME)")
    a.add_argument("--distribution", help="member distribution (default moe-ep-drop-NAME)")
    a.add_argument("--origin-repo")
    a.add_argument("--origin-commit")

    for cmd, helptext in (
        ("sync", "materialize src/ from the pin"),
        ("verify", "offline check against the lock"),
        ("outdated", "is upstream ahead of the pin"),
        ("lint", "metadata and layout checks"),
        ("licenses", "license files and SPDX headers"),
    ):
        s = sub.add_parser(cmd, parents=[common], help=helptext)
        s.add_argument("names", nargs="*", metavar="NAME")
        s.add_argument("--all", action="store_true", help="every drop under vendor/")
        if cmd == "sync":
            s.add_argument(
                "--to", metavar="REV", help="re-pin: git commit/ref, PyPI version, or dir"
            )
            s.add_argument("--sha256", help="with --to on a PyPI source: the new artifact's sha256")
            s.add_argument("--force", action="store_true", help="discard local edits in src/")
        if cmd == "verify":
            s.add_argument("--present", action="store_true", help="only materialized drops")

    d = sub.add_parser("diff", parents=[common], help="diff the drop against a revision")
    d.add_argument("name")
    d.add_argument("--against", metavar="REV")
    d.add_argument("--head", action="store_true")

    sub.add_parser("status", parents=[common], help="one table over all drops")

    f = sub.add_parser("pull-file", parents=[common], help="take one file from a newer revision")
    f.add_argument("name")
    f.add_argument("path")
    f.add_argument("--rev", required=True)
    f.add_argument("--reason", required=True)
    return p


def _emit(args: argparse.Namespace, payload: Any, human: Callable[[], None]) -> None:
    if args.json:
        print(json.dumps(payload, indent=2))
    else:
        human()


def _print_problems(result: dict[str, Any]) -> None:
    mark = "ok" if result.get("ok") else "FAILED"
    print(f"{result['name']}: {mark}")
    for pr in result.get("problems", []):
        print(f"  {pr['check']}: {pr['path']}: {pr['detail']}")


def _each(args: argparse.Namespace, root: Path, fn: Callable[[str], dict[str, Any]]) -> int:
    names = select_drops(root, args.names, args.all)
    results = [fn(n) for n in names]
    bad = [r for r in results if not r.get("ok", True)]

    def human() -> None:
        for r in results:
            _print_problems(r)

    _emit(args, results, human)
    return EXIT_MISMATCH if bad else EXIT_OK


def _pin_from_args(args: argparse.Namespace) -> Pin:
    if args.git:
        return Pin("git", {"url": args.git, "commit": args.commit, "subdir": args.subdir})
    if args.path:
        return Pin("path", {"path": args.path, "subdir": args.subdir})
    dist, sep, version = args.pypi.partition("==")
    if not sep or not dist or not version:
        raise UsageError(
            f"--pypi must be DIST==VERSION, e.g. flashinfer-python==0.7.2.post1; got {args.pypi!r}"
        )
    fields = {"distribution": dist, "version": version, "subdir": args.subdir}
    fields |= {k: v for k, v in (("artifact", args.artifact), ("sha256", args.sha256)) if v}
    return Pin("pypi", fields)


def _run(args: argparse.Namespace) -> int:
    root = (args.root or default_root()).resolve()
    progress = make_progress(args.quiet or args.json)
    cmd = args.command

    if cmd == "add":
        pin = complete_pin(_pin_from_args(args), root, progress)
        r = ops.add(
            root,
            args.name,
            pin,
            progress,
            description=args.description,
            spdx=args.spdx,
            package=args.package,
            distribution=args.distribution,
            consumers=tuple(args.consumer),
            include=tuple(args.include or ["**"]),
            exclude=tuple(args.exclude),
            license_files=tuple(args.license_file),
            origin_repo=args.origin_repo,
            origin_commit=args.origin_commit,
        )
        _emit(args, r, lambda: print(f"{r['name']}: added {r['files']} files at {r['dir']}"))
        return EXIT_OK

    if cmd == "sync":
        names = select_drops(root, args.names, args.all)
        if args.to and len(names) != 1:
            raise UsageError("--to re-pins one drop; name exactly one")
        results = [
            ops.sync(root, n, progress, to=args.to, force=args.force, sha256=args.sha256)
            for n in names
        ]

        def human_sync() -> None:
            for r in results:
                extra = f", absorbed {r['absorbed']}" if r.get("absorbed") else ""
                print(f"{r['name']}: {r['action']} ({r['files']} files){extra}")

        _emit(args, results, human_sync)
        return EXIT_OK

    if cmd == "verify":
        if args.present:
            if args.names or args.all:
                raise UsageError("--present takes no names and no --all")
            args.names = [n for n in drop_names(root) if (root / "vendor" / n / "src").is_dir()]
            if not args.names:
                _emit(args, [], lambda: print("no materialized drops to verify"))
                return EXIT_OK
        return _each(args, root, lambda n: checks.verify(root, n))

    if cmd == "lint":
        return _each(args, root, lambda n: checks.lint(root, n))

    if cmd == "licenses":

        def lic(n: str) -> dict[str, Any]:
            r = checks.licenses(root, n)
            if not args.json:
                print(
                    f"{n}: declared {r['spdx']}; headers {r['headers']}; "
                    f"{len(r['without_header'])} files without an SPDX header; "
                    f"license files {r['license_files'] or 'none'}"
                )
            return r

        return _each(args, root, lic)

    if cmd == "outdated":
        names = select_drops(root, args.names, args.all)
        results = [ops.outdated(root, n, progress) for n in names]

        def human_out() -> None:
            for r in results:
                state = "upstream ahead" if r["ahead"] else "up to date"
                print(f"{r['name']}: {state} (pinned {r['pinned']}, upstream {r['head']})")
                for k, v in r["files"].items():
                    for path in v:
                        print(f"  {k}: {path}")

        _emit(args, results, human_out)
        return EXIT_MISMATCH if any(r["ahead"] for r in results) else EXIT_OK

    if cmd == "diff":
        r = ops.diff(root, args.name, progress, against=args.against, head=args.head)

        def human_diff() -> None:
            sys.stdout.write(r["diff"])
            s = r["summary"]
            print(
                f"{r['name']}: {len(s['added'])} added, {len(s['removed'])} removed, "
                f"{len(s['modified'])} modified, {len(s['mode'])} mode changes "
                f"(subdir {r['subdir'] or '.'})"
            )

        _emit(args, r, human_diff)
        return EXIT_OK if r["identical"] else EXIT_MISMATCH

    if cmd == "status":
        rows = checks.status(root)

        def human_status() -> None:
            from rich.console import Console
            from rich.table import Table

            t = Table(title="vendored drops")
            for col in (
                "name",
                "kind",
                "pin",
                "synced",
                "age",
                "pending",
                "materialized",
                "verified",
            ):
                t.add_column(col, no_wrap=True)
            for r in rows:
                t.add_row(
                    r["name"],
                    r.get("kind", "?"),
                    str(r.get("pin", "?"))[:24],
                    r.get("sync_date", ""),
                    f"{r.get('age_days')}d",
                    str(r["pending"]),
                    "yes" if r["materialized"] else "no",
                    "yes" if r["verified"] else "NO",
                )
            Console(width=None if sys.stdout.isatty() else 120).print(t)

        _emit(args, rows, human_status)
        return EXIT_OK

    if cmd == "pull-file":
        r = ops.pull_file(root, args.name, args.path, args.rev, args.reason, progress)
        _emit(
            args,
            r,
            lambda: print(
                f"{r['name']}: {r['action']} {r['path']} ({r['from_rev']} -> {r['to_rev']})"
            ),
        )
        return EXIT_OK
    raise UsageError(f"unknown command {cmd!r}")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; the only place that decides the exit code."""
    try:
        args = _parser().parse_args(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _run(args)
    except VendorError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(exc), "exit_code": exc.exit_code}))
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted; drops are left as they were before this command", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

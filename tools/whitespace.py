"""Whitespace checks for pre-commit: `trailing FILE...` and `eof FILE...`; exit 1 on findings."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"trailing", "eof"}:
        print("usage: whitespace.py {trailing,eof} FILE...", file=sys.stderr)
        return 2
    mode, paths = argv[0], argv[1:]
    bad = 0
    for path in paths:
        with open(path, "rb") as fh:
            data = fh.read()
        if mode == "trailing":
            for lineno, line in enumerate(data.split(b"\n"), 1):
                if line.rstrip(b"\r").endswith((b" ", b"\t")):
                    print(f"{path}:{lineno}: trailing whitespace")
                    bad += 1
        elif data and not data.endswith(b"\n"):
            print(f"{path}: no newline at end of file")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

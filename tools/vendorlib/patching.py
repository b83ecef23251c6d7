"""Unified diffs of one text file, made and applied strictly (context must match exactly).

`[[pending]]` patches are written by `pull-file` and re-applied by `sync`; `verify` checks
them offline by applying them in reverse to the bytes in src/.
"""

from __future__ import annotations

import difflib
import re

from vendorlib.errors import MismatchError

__all__ = ["apply_patch", "make_patch", "reverse_patch"]

_NO_EOL = "\\ No newline at end of file\n"
_HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _lines(data: bytes, what: str) -> list[str]:
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        raise MismatchError(
            f"{what} is not UTF-8 text; pending patches cover text files only"
        ) from None


def make_patch(old: bytes, new: bytes, path: str) -> str:
    """A unified diff (3 lines of context) turning `old` into `new`; '' when equal."""
    out: list[str] = []
    for line in difflib.unified_diff(
        _lines(old, path), _lines(new, path), f"a/{path}", f"b/{path}", n=3
    ):
        if line.startswith(("---", "+++")):
            out.append(line.rstrip("\n") + "\n")
        elif line.endswith("\n"):
            out.append(line)
        else:
            out.append(line + "\n" + _NO_EOL)
    return "".join(out)


def reverse_patch(patch: str) -> str:
    """The same patch turning `new` back into `old`."""
    out: list[str] = []
    for line in patch.splitlines(keepends=True):
        if line.startswith("--- a/"):
            out.append("--- " + "a/" + line[6:])
        elif line.startswith("+++ b/"):
            out.append(line)
        elif m := _HUNK.match(line):
            a, b, c, d = m.group(1), m.group(2), m.group(3), m.group(4)
            old = a + (f",{b}" if b is not None else "")
            new = c + (f",{d}" if d is not None else "")
            out.append(f"@@ -{new} +{old} @@" + line[m.end() :])
        elif line.startswith("+"):
            out.append("-" + line[1:])
        elif line.startswith("-"):
            out.append("+" + line[1:])
        else:
            out.append(line)
    return "".join(out)


def apply_patch(old: bytes, patch: str, path: str) -> bytes:
    """Apply `patch` to `old`; any context or removed line that differs raises MismatchError."""
    src = _lines(old, path)
    result: list[str] = []
    pos = 0
    lines = patch.splitlines(keepends=True)
    i = 0
    while i < len(lines) and not lines[i].startswith("@@"):
        i += 1
    while i < len(lines):
        m = _HUNK.match(lines[i])
        if not m:
            raise MismatchError(f"{path}: malformed patch line {i + 1}: {lines[i]!r}")
        start = int(m.group(1)) - (0 if m.group(2) == "0" else 1)
        if start < pos:
            raise MismatchError(f"{path}: patch hunks overlap at line {i + 1}")
        result.extend(src[pos:start])
        pos = start
        i += 1
        while i < len(lines) and not lines[i].startswith("@@"):
            line = lines[i]
            tag, text = line[:1], line[1:]
            if i + 1 < len(lines) and lines[i + 1] == _NO_EOL:
                text = text[:-1] if text.endswith("\n") else text
                i += 1
            if tag in (" ", "-"):
                if pos >= len(src) or src[pos] != text:
                    got = src[pos] if pos < len(src) else "<end of file>"
                    raise MismatchError(
                        f"{path}: patch does not apply at line {pos + 1}: "
                        f"expected {text!r}, found {got!r}"
                    )
                if tag == " ":
                    result.append(text)
                pos += 1
            elif tag == "+":
                result.append(text)
            elif line == _NO_EOL:
                pass
            else:
                raise MismatchError(f"{path}: malformed patch line {i + 1}: {line!r}")
            i += 1
    result.extend(src[pos:])
    return "".join(result).encode("utf-8")

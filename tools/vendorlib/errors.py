"""Errors of the vendor tool, each carrying the process exit code `main` maps it to."""

from __future__ import annotations

__all__ = [
    "EXIT_MISMATCH",
    "EXIT_OK",
    "EXIT_SOURCE",
    "EXIT_USAGE",
    "MismatchError",
    "SourceError",
    "UsageError",
    "VendorError",
]

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_SOURCE = 3


class VendorError(Exception):
    """Base of the tool's errors; `exit_code` is what the CLI returns for it."""

    exit_code = EXIT_MISMATCH


class MismatchError(VendorError):
    """A check failed: bytes differ from the lock, a patch does not reproduce, local edits."""

    exit_code = EXIT_MISMATCH


class UsageError(VendorError):
    """Bad arguments or a malformed VENDOR.md / lock (names the file, key and value)."""

    exit_code = EXIT_USAGE


class SourceError(VendorError):
    """The source cannot be reached, lacks the pinned revision or subdir, or fails its sha256."""

    exit_code = EXIT_SOURCE

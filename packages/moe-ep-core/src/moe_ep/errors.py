"""moe-ep exception families.

Usage and configuration mistakes raise `MoeEpUsageError` (a `ValueError`), always before any
collective starts, so one bad rank cannot hang the others. Failures of peers and bounded waits
raise `MoeEpPeerError` / `MoeEpTimeoutError` (`RuntimeError`s) that name the rank(s) involved.
A capability this machine lacks (no GPU, missing package, drop not materialized) raises
`MoeEpUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "MoeEpError",
    "MoeEpPeerError",
    "MoeEpTimeoutError",
    "MoeEpUnavailableError",
    "MoeEpUsageError",
]


class MoeEpError(Exception):
    """Base of every exception moe-ep raises on purpose."""


class MoeEpUsageError(MoeEpError, ValueError):
    """A bad argument, config or input tensor; names the argument, the rule and the value."""


class MoeEpUnavailableError(MoeEpError, RuntimeError):
    """The requested capability cannot run on this machine; the message says why."""


class MoeEpPeerError(MoeEpError, RuntimeError):
    """A peer rank failed (died, errored) during a collective; names the rank(s).

    `rank_errors` maps each failed rank to the class name of the exception it raised, where
    that is known (`moe_ep.launch.spawn_local` fills it); empty otherwise.
    """

    def __init__(self, message: str, *, rank_errors: Mapping[int, str] | None = None) -> None:
        super().__init__(message)
        self.rank_errors: dict[int, str] = dict(rank_errors or {})


class MoeEpTimeoutError(MoeEpPeerError, TimeoutError):
    """A bounded wait ran out; names the missing ranks, world size and the timeout."""

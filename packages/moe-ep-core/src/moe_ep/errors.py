"""moe-ep exception families.

Usage and configuration mistakes raise `MoeEpUsageError` (a `ValueError`), always before any
collective starts, so one bad rank cannot hang the others. Failures of peers and bounded waits
raise `MoeEpPeerError` / `MoeEpTimeoutError` (`RuntimeError`s) that name the rank(s) involved.
A capability this machine lacks (no GPU, missing package, drop not materialized) raises
`MoeEpUnavailableError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

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
    """A peer rank failed (died, stopped, errored) during a collective; names the rank(s).

    `failed_ranks` are the EP ranks the survivors agreed had failed (sorted; the same tuple,
    and the same exception class, on every survivor of one fault), `reasons` what is known
    about each (e.g. the error a rank raised on its own bad input), both empty where
    nothing could be agreed. `rank_errors` maps each failed rank to the class name of the
    exception it raised, where that is known (`moe_ep.spawn.spawn_local` fills it).
    """

    def __init__(
        self,
        message: str,
        *,
        rank_errors: Mapping[int, str] | None = None,
        failed_ranks: Iterable[int] = (),
        reasons: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.rank_errors: dict[int, str] = dict(rank_errors or {})
        self.failed_ranks: tuple[int, ...] = tuple(sorted(set(failed_ranks)))
        self.reasons: dict[int, str] = dict(reasons or {})

    def __reduce__(self) -> tuple[Any, ...]:
        # keep the attributes across pickling (a rank's error sent to its launcher)
        fields = {
            "rank_errors": self.rank_errors,
            "failed_ranks": self.failed_ranks,
            "reasons": self.reasons,
        }
        return (_rebuild, (type(self), str(self), fields))


class MoeEpTimeoutError(MoeEpPeerError, TimeoutError):
    """A bounded wait ran out; names the missing ranks, world size and the timeout."""


def _rebuild(cls: type[MoeEpPeerError], message: str, fields: dict[str, Any]) -> MoeEpPeerError:
    return cls(message, **fields)

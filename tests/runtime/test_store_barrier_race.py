"""`store_barrier` when a peer arrives and then fails between this rank's two polls: the
barrier held for that peer, so it holds here too (before, this rank raised the peer's later
failure as the barrier's, while the peer had gone through: a race seen once in CI, in
`test_apply_placement_moves_weights_and_keeps_the_bits`)."""

from __future__ import annotations

from typing import Any

import pytest

from moe_ep.errors import MoeEpPeerError
from moe_ep.runtime.store import store_barrier


class _Store:
    """Arrival keys that appear after `arrive_after` checks."""

    def __init__(self, arrive_after: int) -> None:
        self.checks = 0
        self.arrive_after = arrive_after

    def add(self, key: str, n: int, deadline: float) -> int:
        return 1

    def set(self, key: str, value: bytes, deadline: float) -> None:
        pass

    def check(self, keys: list[str], deadline: float) -> bool:
        self.checks += 1
        return self.checks > self.arrive_after


class _Keys:
    def key(self, name: str) -> str:
        return name

    def pack(self, key: str, value: bytes) -> bytes:
        return value


class _Board:
    """A peer's failure already on the board."""

    def is_open(self, deadline: float) -> bool:
        return True

    def agree(self, why: str) -> Any:
        return _Verdict()


class _Verdict:
    def error(self, what: str, **kw: Any) -> MoeEpPeerError:
        return MoeEpPeerError(f"{what}: rank 0 failed")


def _barrier(store: _Store) -> None:
    store_barrier(
        store,  # type: ignore[arg-type]
        "b",
        keys=_Keys(),  # type: ignore[arg-type]
        board=_Board(),  # type: ignore[arg-type]
        rank=1,
        world_size=2,
        timeout_s=5.0,
        what="moe-ep barrier",
    )


def test_a_peer_that_arrived_before_failing_lets_the_barrier_hold() -> None:
    store = _Store(arrive_after=1)  # not there at the first check, there at the next
    _barrier(store)
    assert store.checks == 2


def test_a_failure_before_every_rank_arrived_still_ends_the_wait() -> None:
    with pytest.raises(MoeEpPeerError, match="rank 0 failed"):
        _barrier(_Store(arrive_after=10**9))

"""Eviction: after a verdict naming failed EP ranks, the survivors rebuild the EP group over
themselves through the store and keep serving the same logical experts (docs/placement.md).

`check_mode` (construction), `survivor_placement` (the old layout without the failed ranks'
slots), `check_eviction` (the local checks, before any collective) and `rebuild_group`
(the new gloo group, its sealed keys and fault board, every wait bounded).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from moe_ep.errors import (
    MoeEpPeerError,
    MoeEpTimeoutError,
    MoeEpUnavailableError,
    MoeEpUsageError,
)
from moe_ep.placement import Placement
from moe_ep.runtime.bounded import call_with_deadline, grace_s
from moe_ep.runtime.faults import FaultBoard
from moe_ep.runtime.state import PROCESS, RuntimeState

__all__ = [
    "EVICTION_MODES",
    "check_eviction",
    "check_mode",
    "rebuild_group",
    "survivor_placement",
]

EVICTION_MODES = ("mask", "replicate")

_ABANDONED: list[Any] = []
"""The groups eviction left behind: kept referenced, since dropping one runs its backend's
destructor, which joins worker threads an abandoned collective may still hold."""


_OUTSIDE_STORE = (
    "To survive losing any rank, rank 0 included, serve the store outside the EP ranks: "
    "moe_ep.runtime.store_server.serve_store() in the launcher (or `python -m "
    "moe_ep.runtime.store_server` on a host of its own) and BootstrapConfig("
    "external_store=True, init_method=its address) on every rank; under torchrun too, "
    "since its agent store lives in node 0's agent, which exits with a failed worker "
    "(docs/placement.md, 'Eviction')"
)


def check_mode(mode: str | None, placement: Placement) -> None:
    """The construction's check of `eviction=` (None: `evict()` is refused)."""
    if mode is None:
        return
    if mode not in EVICTION_MODES:
        raise MoeEpUsageError(f"eviction must be None, 'mask' or 'replicate', got {mode!r}")
    if mode == "replicate":
        single = [e for e, r in enumerate(placement.replicas) if _ranks_of(placement, r) < 2]
        if single:
            raise MoeEpUsageError(
                "eviction='replicate' needs a placement with every expert on at least two "
                f"ranks: experts {single[:8]} are on one (placement {placement!r}); e.g. "
                "balance_placement(load, world_size, num_redundant=num_experts), or use "
                "eviction='mask'"
            )


def _ranks_of(placement: Placement, slots: Sequence[int]) -> int:
    return len({placement.rank_of_slot(p) for p in slots})


def survivor_placement(placement: Placement, failed: Sequence[int], mode: str) -> Placement:
    """`placement` without the failed ranks' slots, over the renumbered survivors; experts
    left with no copy are masked (mode 'mask') or refused (mode 'replicate')."""
    dead = set(failed)
    survivors = [r for r in range(placement.world_size) if r not in dead]
    slots = tuple(e for r in survivors for e in placement.rank_slots(r))
    lost = sorted(set(range(placement.num_experts)) - set(slots) - set(placement.masked))
    if lost and mode == "replicate":
        raise MoeEpUsageError(
            f"eviction='replicate' cannot go on without ranks {sorted(dead)}: experts "
            f"{lost[:8]} had every copy there (with one copy on each of two ranks, only one "
            "failure at a time is covered); destroy the layer and restart"
        )
    return Placement(
        placement.num_experts,
        len(survivors),
        slots,
        tuple(sorted(set(placement.masked) | set(lost))),
    )


def check_eviction(
    runtime: Any, mode: str | None, failed_ranks: object
) -> tuple[RuntimeState, tuple[int, ...]]:
    """Local checks of `evict(failed_ranks)` (no collective, no store call): the runtime
    state and the failed ranks as a sorted tuple."""
    if mode is None:
        raise MoeEpUsageError(
            "evict() needs a layer constructed with eviction='mask' or eviction='replicate'"
        )
    state = PROCESS.state
    if state is None or runtime.released or runtime.group is not state.group:
        raise MoeEpUsageError("evict(): this layer's runtime is not the process's active one")
    if not isinstance(failed_ranks, Sequence | set | frozenset) or not all(
        type(r) is int for r in failed_ranks
    ):
        raise MoeEpUsageError(
            f"failed_ranks must be a sequence of EP ranks (ints), got {failed_ranks!r}"
        )
    failed = tuple(sorted(set(failed_ranks)))
    cause = state.broken
    if cause is None:
        raise MoeEpUsageError(
            f"evict(failed_ranks={list(failed)}): the EP group is healthy (no failure "
            "verdict); eviction follows a MoeEpPeerError naming the failed ranks"
        )
    if tuple(sorted(cause.failed_ranks)) != failed:
        raise MoeEpUsageError(
            f"evict(failed_ranks={list(failed)}) must name the ranks of the verdict every "
            f"survivor raised, {sorted(cause.failed_ranks)}"
        )
    if not failed:
        raise MoeEpUsageError(
            "evict(): the verdict could not name the failed ranks; destroy the layer and restart"
        )
    if state.rank in failed:
        raise MoeEpUsageError(
            f"evict(): this rank ({state.rank}) is among the failed ranks {list(failed)}: an "
            "evicted rank cannot rejoin (its peers serve without it); destroy this layer"
        )
    if not state.created_group or state.store is None or state.board is None:
        raise MoeEpUnavailableError(
            "evict() needs the EP group moe-ep created (a host's process_group or default "
            "group is the host's to rebuild)"
        )
    if state.backend != "gloo":
        raise MoeEpUnavailableError(
            f"evict() rebuilds a gloo group (CPU); this runtime's group is {state.backend}, "
            "whose rebuild is not supported: restart the processes"
        )
    host = state.store.host_rank
    if host is not None and host in failed:
        raise MoeEpUnavailableError(
            f"evict(): the rendezvous store's host (EP rank {host}) is among the failed "
            f"ranks {list(failed)}: the survivors cannot rebuild through its store; restart "
            f"the processes. {_OUTSIDE_STORE}"
        )
    if state.store.lost is not None:
        raise MoeEpUnavailableError(
            f"evict(failed_ranks={list(failed)}): the rendezvous store is gone "
            f"({state.store.lost}): the survivors cannot rebuild without it; restart the "
            f"processes. {_OUTSIDE_STORE}"
        )
    return state, failed


def rebuild_group(state: RuntimeState, failed: tuple[int, ...]) -> list[int]:
    """Collective over the survivors: a new gloo group of them, made through the store,
    with this lifetime's keys under a child namespace and a fault board of the new size;
    returns the survivors' old ranks (new rank i was old rank `survivors[i]`).

    A survivor failing here makes every other survivor raise one verdict, in the old
    numbering (the failed ranks plus the new victims); the state keeps its old group and
    numbering, broken, so `evict` can run again with that verdict.
    """
    assert state.store is not None and state.board is not None
    old_rank, old_size = state.rank, state.world_size
    survivors = [r for r in range(old_size) if r not in failed]
    global_ranks = [dist.get_global_rank(state.group, r) for r in survivors]
    keys = state.keys.child("evict/" + "-".join(map(str, failed)))
    new_rank = survivors.index(old_rank)
    timeout_s = state.timeout_s
    saved = (state.rank, state.world_size, state.keys, state.board, state.barrier_gen)
    old_group, old_backend = state.group, state.backend
    state.rank, state.world_size, state.keys = new_rank, len(survivors), keys
    state.board = FaultBoard(
        state.store,
        keys.child("fault"),
        rank=new_rank,
        world_size=len(survivors),
        timeout_s=timeout_s,
    )
    state.barrier_gen, state.broken = 0, None
    try:
        state.store_barrier("joined", "moe-ep evict (survivors joining)")
        group_timeout = datetime.timedelta(seconds=timeout_s + 2 * grace_s(timeout_s))
        group = call_with_deadline(
            lambda: dist.new_group(
                global_ranks,
                timeout=group_timeout,
                backend="gloo",
                use_local_synchronization=True,
            ),
            timeout_s,
            "creating the survivors' gloo group",
        )
        _ABANDONED.append(old_group)
        state.group = group
        state.backend = "gloo"
        state.store_barrier("ready", "moe-ep evict (survivors' group created)")
    except Exception as exc:
        seen = exc
        if not isinstance(exc, MoeEpPeerError):  # this rank's own error: agree on who failed
            seen = state.board.agree(f"{type(exc).__name__}: {exc}").error(
                "moe-ep evict", rank=new_rank, world_size=len(survivors), timeout_s=timeout_s
            )
        error = _in_old_numbering(seen, failed, survivors, old_rank, old_size, timeout_s)
        state.rank, state.world_size, state.keys, state.board, state.barrier_gen = saved
        if state.group is not old_group:  # made, then a survivor failed: keep it referenced
            _ABANDONED.append(state.group)
            state.group, state.backend = old_group, old_backend
        state.broken = error
        raise error from exc
    return survivors


def _in_old_numbering(
    exc: BaseException,
    failed: tuple[int, ...],
    survivors: list[int],
    rank: int,
    world_size: int,
    timeout_s: float,
) -> MoeEpPeerError:
    """The eviction's verdict (new ranks) as the old group's: the ranks failed before plus
    the survivors that failed now, so `evict` can be called again with it."""
    new_failed: tuple[int, ...] = ()
    reasons: dict[int, str] = {}
    if isinstance(exc, MoeEpPeerError):
        new_failed = tuple(survivors[r] for r in exc.failed_ranks)
        reasons = {survivors[r]: why for r, why in exc.reasons.items()}
    all_failed = tuple(sorted(set(failed) | set(new_failed)))
    cls = MoeEpTimeoutError if isinstance(exc, MoeEpTimeoutError) else MoeEpPeerError
    return cls(
        f"moe-ep evict: the eviction of ranks {list(failed)} failed: {exc} (ranks in the "
        f"numbering before the eviction: rank(s) {list(all_failed)} failed; world size "
        f"{world_size}, seen from rank {rank}, timeout {timeout_s:g} s); call evict() with "
        "these ranks, or destroy every layer and release the runtime",
        failed_ranks=all_failed,
        reasons=reasons,
    )

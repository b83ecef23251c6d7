"""Tearing a runtime down: collective on a healthy one, local and bounded on a broken one."""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist

from moe_ep.runtime.bounded import call_with_deadline
from moe_ep.runtime.nvshmem_init import finalize_nvshmem
from moe_ep.runtime.state import RuntimeState

__all__ = ["destroy_group_locally", "linger_and_close", "teardown", "teardown_broken"]


_GROUP_SHUTDOWN_S = 2.0
"""How long a broken runtime's teardown waits for torch to drop its process group."""


def destroy_group_locally() -> None:
    """`destroy_process_group` without waiting on peers: torch joins the group's worker
    threads, which block until an abandoned collective's own timeout (gloo's default is 30
    minutes), so it runs on a daemon thread; torch.distributed is uninitialised before that
    join, so this process can bootstrap again at once."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(TimeoutError):
        call_with_deadline(dist.destroy_process_group, _GROUP_SHUTDOWN_S, "destroying the group")


def linger_and_close(state: RuntimeState) -> None:
    """Stop using the store; its host first waits (at most `grace`) for the peers still
    reading a verdict from it."""
    if state.board is not None and state.store is not None and state.store.host_rank == state.rank:
        state.board.linger(time.monotonic() + state.board.grace)
    if state.store is not None:
        state.store.close()
    state.store = state.board = None


def teardown_broken(state: RuntimeState) -> None:
    """Local teardown of a broken runtime: no barrier, no collective, bounded."""
    linger_and_close(state)
    if state.created_group:
        destroy_group_locally()
    state.group = None


def teardown(state: RuntimeState) -> None:
    """What the last release does: barrier -> destroy -> barrier for what moe-ep created
    (NVSHMEM, the group), each bounded; local and immediate on a broken runtime."""
    if state.broken is not None:
        teardown_broken(state)
        return
    errors: list[BaseException] = []
    if state.created_nvshmem:
        try:
            state.barrier("moe-ep teardown (before NVSHMEM finalize)")
            finalize_nvshmem()
        except BaseException as exc:
            errors.append(exc)
    if state.created_group:
        try:
            if not errors:
                state.store_barrier(
                    "teardown/enter", "moe-ep teardown (before destroying the process group)"
                )
        except BaseException as exc:
            errors.append(exc)
        finally:
            # Destroy locally even when a peer is gone, so this process is usable again.
            if errors:
                destroy_group_locally()
            elif dist.is_initialized():
                dist.destroy_process_group()
        if not errors:
            try:
                state.store_barrier(
                    "teardown/exit",
                    "moe-ep teardown (after destroying the process group)",
                    host_waits_for_exit=True,
                )
            except BaseException as exc:
                errors.append(exc)
    linger_and_close(state)
    state.group = None
    if errors:
        raise errors[0]

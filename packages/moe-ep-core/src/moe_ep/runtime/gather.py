"""Bounded all-gather of small JSON-able values over the EP group (setup checks)."""

from __future__ import annotations

import datetime
import json
from typing import Any

from moe_ep.errors import MoeEpTimeoutError

__all__ = ["gather_json"]


def _wait(work: Any, timeout: datetime.timedelta, what: str, rank: int, world: int) -> None:
    message = (
        f"{what}: not every rank arrived within {timeout.total_seconds():g} s (world size "
        f"{world}, seen from rank {rank})"
    )
    try:
        done = work.wait(timeout)
    except Exception as exc:
        raise MoeEpTimeoutError(f"{message}: {exc}") from exc
    if done is False:
        raise MoeEpTimeoutError(message)


def gather_json(
    group: Any, payload: Any, *, device: Any, timeout: datetime.timedelta, what: str
) -> list[Any]:
    """Every rank's JSON-able `payload`, in rank order (collective over `group`).

    Two `all_gather`s (lengths, then padded UTF-8 bytes) of tensors on `device` (CPU for
    gloo, the rank's GPU for NCCL), each wait bounded by `timeout`.

    Raises:
        MoeEpTimeoutError: a gather did not complete in time (names `what`, the world size
            and this rank).
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    data = json.dumps(payload, sort_keys=True).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    _wait(dist.all_gather(sizes, size, group=group, async_op=True), timeout, what, rank, world)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    outs = [torch.empty_like(buf) for _ in range(world)]
    _wait(dist.all_gather(outs, buf, group=group, async_op=True), timeout, what, rank, world)
    return [
        json.loads(bytes(o[:n].cpu().tolist()).decode()) for o, n in zip(outs, lengths, strict=True)
    ]

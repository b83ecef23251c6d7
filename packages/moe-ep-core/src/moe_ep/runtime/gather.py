"""Bounded all-gather of small JSON-able values over the EP group (setup checks)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["gather_json"]


def gather_json(group: Any, payload: Any, *, device: Any, wait: Callable[[Any], None]) -> list[Any]:
    """Every rank's JSON-able `payload`, in rank order (collective over `group`).

    Two `all_gather`s (lengths, then padded UTF-8 bytes) of tensors on `device` (CPU for
    gloo, the rank's GPU for NCCL), each posted `async_op=True` and handed to `wait` (the
    runtime's bounded wait, which raises the agreed verdict when a rank fails).
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    data = json.dumps(payload, sort_keys=True).encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    wait(dist.all_gather(sizes, size, group=group, async_op=True))
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(lengths), dtype=torch.uint8)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    outs = [torch.empty_like(buf) for _ in range(world)]
    wait(dist.all_gather(outs, buf, group=group, async_op=True))
    return [
        json.loads(bytes(o[:n].cpu().tolist()).decode()) for o, n in zip(outs, lengths, strict=True)
    ]

"""A local Ray cluster, one actor per EP rank (CPU, gloo): the driver hands the rendezvous
address to the actors, one actor is killed mid-serving, and the survivors (auto_evict,
replicate mode) keep serving with the same bits. Ray is optional (never a dependency of
moe-ep); run with `uv run --with ray pytest tests/layer/test_evict_ray.py`."""

from __future__ import annotations

from typing import Any

import pytest

from moe_ep.spawn import free_port

ray = pytest.importorskip("ray", reason="Ray is optional: uv run --with ray pytest ...")

pytestmark = pytest.mark.multirank


def test_ray_actor_killed_mid_serving_survivors_keep_the_bits() -> None:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        _serve_and_kill()
    finally:
        ray.shutdown()


def _serve_and_kill() -> None:
    @ray.remote(num_cpus=1)
    class EpRank:  # defined here: Ray pickles it by value, no test module import in the actor
        def __init__(self, rank: int, world_size: int, init_method: str) -> None:
            self.args = (rank, world_size, init_method)

        def setup(self) -> None:  # collective: every actor's setup runs at once
            import torch

            from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
            from moe_ep.placement import Placement
            from moe_ep.placement_weights import slice_weights

            torch.set_num_threads(1)
            rank, world, init_method = self.args
            e, h, i, k, t = 8, 128, 64, 2, 12
            per = e // world
            p = Placement.from_rank_slots(
                e,
                [list(range(r * per, (r + 2) * per)) if r + 1 < world
                 else list(range(r * per, e)) + list(range(per)) for r in range(world)],
            )  # fmt: skip
            g = torch.Generator().manual_seed(7)
            w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
            w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
            g = torch.Generator().manual_seed(100 + rank)
            x = torch.randn(t, h, generator=g).bfloat16()
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
            self.tensors = MoEEpTensors(x, ids, torch.rand(t, k, generator=g))
            self.layer = MoEEpLayer(
                # on a GPU node: device=<the actor's assigned device ordinal>
                BootstrapConfig(world, rank, init_method=init_method, timeout_s=3.0),
                FleetParams(e, t, h, placement=p),
                slice_weights(MoEWeightPack(w13, w2), p, rank),
                "any_bf16_bf16_bf16_torch",
                eviction="replicate",
                auto_evict=True,
            )

        def step(self) -> tuple[list[int], int]:
            y = self.layer(self.tensors)
            return y.view(-1).view(dtype=__import__("torch").int16).tolist(), self.layer.world_size

    world = 4
    address = f"tcp://127.0.0.1:{free_port()}"  # the driver picks it and hands it out
    actors = [EpRank.remote(r, world, address) for r in range(world)]
    ray.get([a.setup.remote() for a in actors], timeout=120)
    first: dict[int, Any] = dict(enumerate(ray.get([a.step.remote() for a in actors], timeout=60)))
    alive = list(range(world))
    for step in range(4):
        refs = {r: actors[r].step.remote() for r in alive}
        if step == 1:  # mid-serving: the step is in flight on every rank
            ray.kill(actors[2])
            alive.remove(2)
        for r in alive:
            bits, size = ray.get(refs[r], timeout=60)
            assert bits == first[r][0], (step, r)  # replicate: the same bits
            assert size == (world if step == 0 else 3) or step == 1
    assert ray.get([actors[r].step.remote() for r in alive], timeout=60)[0][1] == 3

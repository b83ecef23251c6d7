"""A local Ray cluster, one actor per EP rank (CPU, gloo): the driver serves the rendezvous
store (`serve_store`) and hands its address to the actors (`external_store=True`), so no
actor hosts it; the rank-0 actor, then actor 2, are killed mid-serving, and the survivors
(auto_evict, replicate mode) keep serving with the same bits. Ray is optional (the
`moe-ep-core[ray]` extra, never a dependency of moe-ep); run with
`uv run --with 'ray>=2.40' pytest tests/layer/test_evict_ray.py`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moe_ep.runtime.store_server import serve_store

ray = pytest.importorskip(
    "ray", reason="Ray is optional: uv run --with 'ray>=2.40' pytest tests/layer/test_evict_ray.py"
)

pytestmark = pytest.mark.multirank

CASES = str(Path(__file__).parent)  # evict_cases.py and layer_cases.py: the actors import them


def test_ray_actors_killed_mid_serving_rank_0_included_survivors_keep_the_bits() -> None:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        with serve_store("127.0.0.1") as store:  # the driver serves it: no actor hosts it
            _serve_and_kill(store.init_method)
    finally:
        ray.shutdown()


def _serve_and_kill(init_method: str) -> None:
    @ray.remote(num_cpus=1)
    class EpRank:  # defined here: Ray pickles it by value, no test module import in the actor
        def __init__(self, rank: int, world_size: int, init_method: str) -> None:
            self.args = (rank, world_size, init_method)

        def prepare(self) -> list[str]:  # local: imports and inputs, before the collective
            import sys

            found = list(sys.path)  # the worker's own path: the test folder is not on it
            sys.path.insert(0, CASES)
            import torch
            from evict_cases import problem

            from moe_ep import MoEEpTensors

            torch.set_num_threads(1)
            self.p = problem(self.args[0])
            self.tensors = MoEEpTensors(self.p["x"], self.p["ids"], self.p["w"])
            return found

        def setup(self) -> None:  # collective: every actor's setup runs at once
            from evict_cases import E, H, T, two_copies

            from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEWeightPack
            from moe_ep.placement_weights import slice_weights

            rank, world, init_method = self.args
            p = self.p
            placement = two_copies(world)
            self.layer = MoEEpLayer(
                # on a GPU node: device=<the actor's assigned device ordinal>
                BootstrapConfig(
                    world, rank, init_method=init_method, timeout_s=3.0, external_store=True
                ),
                FleetParams(E, T, H, placement=placement),
                slice_weights(MoEWeightPack(p["w13"], p["w2"]), placement, rank),
                "any_bf16_bf16_bf16_torch",
                eviction="replicate",
                auto_evict=True,
            )

        def step(self) -> tuple[list[int], int]:
            y = self.layer(self.tensors)
            return y.view(-1).view(dtype=__import__("torch").int16).tolist(), self.layer.world_size

    world = 4
    actors = [EpRank.remote(r, world, init_method) for r in range(world)]
    # a slow actor start (imports) must not count against the bootstrap's timeout_s
    paths = ray.get([a.prepare.remote() for a in actors], timeout=120)
    assert all(CASES not in p for p in paths)  # so the insert above is what finds evict_cases
    ray.get([a.setup.remote() for a in actors], timeout=120)
    first: dict[int, Any] = dict(enumerate(ray.get([a.step.remote() for a in actors], timeout=60)))
    alive = list(range(world))
    kills = {1: 0, 3: 2}  # step -> the actor killed while that step is in flight
    for step in range(5):
        refs = {r: actors[r].step.remote() for r in alive}
        if step in kills:  # mid-serving: the step is in flight on every rank
            ray.kill(actors[kills[step]])
            alive.remove(kills[step])
        for r in alive:
            bits, size = ray.get(refs[r], timeout=60)
            assert bits == first[r][0], (step, r)  # replicate: the same bits
            if step not in kills:
                assert size == world - sum(k < step for k in kills), (step, r, size)
    assert alive == [1, 3]  # old ranks 1 and 3 hold every expert (evict_cases.two_copies)
    assert [s for _, s in ray.get([actors[r].step.remote() for r in alive], timeout=60)] == [2, 2]

"""A torchrun worker of test_evict_torchrun: world 4 over two agents, every expert on both
nodes; rank `argv[2]` SIGKILLs itself in the second forward; the survivors evict (again
when a rank dies during the eviction: its agent stops its other worker) and check the bits.
With `argv[3]` (a `tcp://` address) the ranks join the store served there
(`external_store=True`) instead of the agent's. Writes `<argv[1]>/<rank>.json`."""

import json
import os
import signal
import sys
import time

import torch
from evict_cases import E, H, T, problem  # this script's folder is on sys.path

from moe_ep import (
    BootstrapConfig,
    FleetParams,
    MoEEpLayer,
    MoeEpPeerError,
    MoEEpTensors,
    MoEWeightPack,
)
from moe_ep.placement import Placement
from moe_ep.placement_weights import slice_weights

torch.set_num_threads(1)
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
kill = int(sys.argv[2])
store = sys.argv[3] if len(sys.argv) > 3 else None
per = E // world
half = world // 2  # rank r also holds rank (r + half)'s experts: every expert on both nodes
p = Placement.from_rank_slots(
    E,
    [
        list(range(r * per, (r + 1) * per))
        + list(range((r + half) % world * per, ((r + half) % world + 1) * per))
        for r in range(world)
    ],
)
prob = problem(rank)  # the eviction tests' weights and this rank's tokens
w13, w2 = prob["w13"], prob["w2"]
t = MoEEpTensors(prob["x"], prob["ids"], prob["w"])
layer = MoEEpLayer(
    BootstrapConfig(world, rank, timeout_s=3.0, init_method=store, external_store=bool(store)),
    FleetParams(E, T, H, placement=p),
    slice_weights(MoEWeightPack(w13, w2), p, rank),
    "any_bf16_bf16_bf16_torch",
    eviction="replicate",
)
before = layer(t)
out = {"rank": rank, "verdicts": [], "evict_errors": []}
if rank == kill:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    layer(t)
except MoeEpPeerError as exc:
    t0 = time.monotonic()
    failed = sorted(exc.failed_ranks)
    out["verdicts"].append(failed)
    for _ in range(3):
        try:
            out["survivors"] = layer.evict(failed)
            break
        except MoeEpPeerError as e2:
            failed = sorted(e2.failed_ranks)
            out["evict_errors"].append(str(e2)[:300])
    after = layer(t)
    out["recover_s"] = time.monotonic() - t0
    out["same_bits"] = bool(torch.equal(after, before))
    out["world_after"] = layer.world_size
layer.destroy()
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as f:
    json.dump(out, f)

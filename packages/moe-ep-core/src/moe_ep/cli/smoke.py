"""`moe-ep smoke`: a serving-like loop on local CPU ranks with a scheduled kill; the
survivors evict the dead rank and go on (docs/placement.md, "Eviction").

Every step each rank forwards fresh tokens; before step `--kill-step` rank `--kill-rank`
(any rank, 0 included: this parent process serves the rendezvous store, the ranks join it
with `external_store=True`) SIGKILLs itself; the survivors get the verdict, `evict` it and
serve that step and the rest. Each survivor prints one line:

    SMOKE_RESULT rank=R verdict=[K] matched_oracle=true|false ...

`matched_oracle`: every step's output within the float64 oracle's band and global check
(`moe_ep.oracle`), the oracle computed with every expert (replicate) or with the lost
experts' top-k weights zeroed (mask: what the mode promises); replicate also reports
`same_bits` (step 0's tokens again after the eviction, bit for bit against step 0). The
rank to be killed forwards no tokens at step 0, so that both forwards see the same global
batch: its per-expert row counts pick each expert's sum order (docs/layer.md,
"Determinism"), and a batch without the dead rank's tokens may cross a threshold.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import warnings
from dataclasses import dataclass
from typing import Any

from moe_ep.errors import MoeEpPeerError, MoeEpUsageError

__all__ = ["SmokeSpec", "add_parser", "run", "smoke_rank"]

_E_PER_RANK, _H, _I, _K, _T = 2, 128, 64, 2, 16
_RUN_BOUND_S = 55.0


@dataclass(frozen=True)
class SmokeSpec:
    world_size: int
    kill_rank: int
    mode: str
    steps: int
    kill_step: int
    timeout_s: float

    def check(self) -> None:
        """Usage errors, before any process starts."""
        if self.world_size < 2:
            raise MoeEpUsageError(f"--world-size must be >= 2, got {self.world_size}")
        if not 0 <= self.kill_rank < self.world_size:
            raise MoeEpUsageError(
                f"--kill-rank must be in [0, --world-size={self.world_size}), got {self.kill_rank}"
            )
        if not 1 <= self.kill_step < self.steps:
            raise MoeEpUsageError(
                f"--kill-step must be in [1, --steps={self.steps}), got {self.kill_step}"
            )
        if not 0.5 <= self.timeout_s <= 10:
            raise MoeEpUsageError(f"--timeout-s must be in [0.5, 10], got {self.timeout_s:g}")


def _placement(spec: SmokeSpec) -> Any:
    from moe_ep.placement import Placement

    w, per = spec.world_size, _E_PER_RANK
    e = w * per
    if spec.mode == "mask":
        return Placement.contiguous(e, w)
    # replicate: rank r holds its own experts and rank r+1's (every expert on two ranks)
    return Placement.from_rank_slots(
        e,
        [
            list(range(r * per, (r + 1) * per))
            + list(range((r + 1) % w * per, ((r + 1) % w + 1) * per))
            for r in range(w)
        ],
    )


def _tokens(rank: int, step: int, num_experts: int) -> tuple[Any, Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(_T, _H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:_K] for _ in range(_T)])
    return x, ids, torch.rand(_T, _K, generator=g)


def smoke_rank(rank: int, world_size: int, spec: SmokeSpec) -> dict[str, Any]:
    """One rank's serving loop (top level, so it can be spawned)."""
    import torch

    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep.oracle import compare_to_oracle, oracle_forward
    from moe_ep.placement_weights import slice_weights

    torch.set_num_threads(1)
    placement = _placement(spec)
    e = placement.num_experts
    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(e, 2 * _I, _H, generator=g) / _H**0.5).bfloat16()
    w2 = (torch.randn(e, _H, _I, generator=g) / _I**0.5).bfloat16()
    layer = MoEEpLayer(
        BootstrapConfig(world_size, rank, timeout_s=spec.timeout_s, external_store=True),
        FleetParams(e, _T, _H, placement=placement),
        slice_weights(MoEWeightPack(w13, w2), placement, rank),
        "any_bf16_bf16_bf16_torch",
        eviction=spec.mode,
    )
    lost: list[int] = []
    matched, verdict, timing, same_bits = True, None, {}, None
    first = None
    try:
        for step in range(spec.steps):
            x, ids, w = _tokens(rank, step, e)
            if step == 0 and rank == spec.kill_rank:  # step 0's batch: the survivors' only
                x, ids, w = x[:0], ids[:0], w[:0]
            tensors = MoEEpTensors(x, ids, w)
            if step == spec.kill_step and rank == spec.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            start = time.monotonic()
            try:
                y = layer(tensors)
            except MoeEpPeerError as exc:
                seen = time.monotonic()
                verdict = sorted(exc.failed_ranks)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the mask warning is the docs' point
                    layer.evict(verdict)
                lost = list(layer.placement.masked)
                y = layer(tensors)
                timing = {"detect_s": seen - start, "recover_s": time.monotonic() - seen}
            if step == 0:
                first = y.clone()
            if x.shape[0]:
                keep = torch.isin(ids, torch.tensor(lost, dtype=torch.long))
                ref = oracle_forward(x, ids, w.masked_fill(keep, 0.0), w13, w2, fmt="bf16")
                matched = matched and compare_to_oracle(y, ref).ok
        if spec.mode == "replicate" and first is not None:
            x, ids, w = _tokens(rank, 0, e)
            same_bits = bool(torch.equal(layer(MoEEpTensors(x, ids, w)), first))
    finally:
        layer.destroy()
    return {"verdict": verdict, "matched": matched, "same_bits": same_bits, "lost": lost,
            **timing}  # fmt: skip


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "smoke",
        help="serving loop on local CPU ranks with a scheduled kill; survivors evict and go on",
        description="Spawns --world-size CPU ranks (gloo) serving --steps forwards, with "
        "the rendezvous store served by this process (so any rank may be killed); rank "
        "--kill-rank SIGKILLs itself before step --kill-step; the survivors evict it "
        "(--mode) and serve the rest. Prints one SMOKE_RESULT line per survivor; exit 0 "
        "when every survivor matched the oracle, 1 otherwise, 4 when a survivor failed.",
    )
    p.add_argument("--world-size", type=int, default=4, help="local ranks (default 4)")
    p.add_argument("--kill-rank", type=int, default=1,
                   help="the rank killed, 0 included (default 1)")  # fmt: skip
    p.add_argument("--mode", choices=("mask", "replicate"), default="replicate",
                   help="eviction mode (default replicate)")  # fmt: skip
    p.add_argument("--steps", type=int, default=5, help="forwards per rank (default 5)")
    p.add_argument("--kill-step", type=int, default=2, help="step of the kill (default 2)")
    p.add_argument("--timeout-s", type=float, default=3.0,
                   help="BootstrapConfig.timeout_s of the ranks (default 3)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from moe_ep.cli.exits import EXIT_CHECK_FAILED, EXIT_OK, EXIT_PEER
    from moe_ep.runtime.store_server import serve_store
    from moe_ep.spawn import launch_local

    spec = SmokeSpec(
        args.world_size, args.kill_rank, args.mode, args.steps, args.kill_step, args.timeout_s
    )
    spec.check()
    start = time.monotonic()
    # the store outlives every rank: no rank's loss, rank 0's included, takes it down
    with serve_store("127.0.0.1") as store:
        env = {"MASTER_ADDR": store.host, "MASTER_PORT": str(store.port)}
        result = launch_local(
            smoke_rank, spec.world_size, spec, timeout_s=_RUN_BOUND_S,
            failure_grace_s=_RUN_BOUND_S, env=env,
        )  # fmt: skip
    code = EXIT_OK
    for rank in range(spec.world_size):
        if rank == spec.kill_rank:
            continue
        res = result.results.get(rank)
        if res is None:
            failure = next((f for f in result.failures if f.rank == rank), None)
            why = failure.message.splitlines()[0] if failure else "no result"
            print(f"SMOKE_RESULT rank={rank} verdict=none matched_oracle=false error={why!r}")
            code = EXIT_PEER
            continue
        verdict = "none" if res["verdict"] is None else ",".join(map(str, res["verdict"]))
        extra = "" if res["same_bits"] is None else f" same_bits={str(res['same_bits']).lower()}"
        print(
            f"SMOKE_RESULT rank={rank} verdict=[{verdict}] "
            f"matched_oracle={str(res['matched']).lower()} mode={spec.mode}{extra} "
            f"masked_experts={res['lost']} detect_s={res.get('detect_s', float('nan')):.2f} "
            f"recover_s={res.get('recover_s', float('nan')):.2f}"
        )
        ok = res["matched"] and res["verdict"] == [spec.kill_rank] and res["same_bits"] is not False
        if not ok and code == EXIT_OK:
            code = EXIT_CHECK_FAILED
    print(f"smoke: {spec.world_size} ranks, rank {spec.kill_rank} killed at step "
          f"{spec.kill_step}, {time.monotonic() - start:.1f} s")  # fmt: skip
    return code

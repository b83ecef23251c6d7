"""Spawn workers of the eviction tests (top-level, so they pickle)."""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any

import torch
from layer_cases import to_wire

from moe_ep.placement import Placement

E, H, INTER, K, T = 8, 128, 64, 2, 12
TIMEOUT_S = 3.0


def two_copies(world_size: int) -> Placement:
    """Rank r holds its contiguous experts and rank r+1's: every expert on two ranks."""
    per = E // world_size
    return Placement.from_rank_slots(
        E,
        [
            list(range(r * per, (r + 1) * per))
            + list(range(((r + 1) % world_size) * per, ((r + 1) % world_size + 1) * per))
            for r in range(world_size)
        ],
    )


def problem(rank: int) -> dict[str, torch.Tensor]:
    """All experts' weights (the same on every rank) and rank `rank`'s tokens."""
    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(E, H, INTER, generator=g) / INTER**0.5).bfloat16()
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return {"w13": w13, "w2": w2, "x": x, "ids": ids, "w": torch.rand(T, K, generator=g)}


def _error(exc: BaseException) -> dict[str, Any]:
    return {
        "error": f"{type(exc).__name__}: {exc}",
        "failed_ranks": sorted(getattr(exc, "failed_ranks", ())),
    }


def _die_in_eviction(eviction: Any) -> None:
    """This rank exits as it builds the eviction's fault board (before its first barrier)."""

    def dying_board(*a: Any, **k: Any) -> Any:
        os._exit(23)

    eviction.FaultBoard = dying_board


def _second_kill(
    layer: Any, tensors: Any, rank: int, plan: dict[str, Any], out: dict[str, Any]
) -> None:
    """After the first eviction: the kill2 ranks SIGKILL themselves; the others' next forward
    raises (explicit evict: "verdict2", "survivors2", "after3") or evicts on its own (auto)."""
    from moe_ep import MoeEpPeerError

    layer._runtime.barrier()  # every survivor past its earlier forwards before the kill
    if rank in plan["kill2"]:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        out["after3"] = to_wire(layer(tensors))
    except MoeEpPeerError as exc:
        out["verdict2"] = _error(exc)
        out["survivors2"] = layer.evict(exc.failed_ranks)
        out["after3"] = to_wire(layer(tensors))
    out["second_s"] = time.monotonic() - t0
    out["new_rank2"], out["new_world2"] = layer.rank, layer.world_size


def _backend(packed: bool) -> Any:
    if not packed:
        return "any_bf16_bf16_bf16_torch"
    from moe_ep.backends.portable.configs import Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig

    return Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(cpu_prepacked_weights=True)


def evict_worker(rank: int, world_size: int, plan: dict[str, Any]) -> dict[str, Any]:
    """Forward 1 (healthy), then the plan's fault in forward 2, then (survivors) evict
    and forward the same tokens again. `plan`: mode, kill (ranks that SIGKILL themselves
    before forward 2), stop (it SIGSTOPs itself, rank 0 resumes it after the eviction), die_in_evict
    (a survivor that dies inside the eviction's first barrier), external (the store is the
    test process's: `external_store=True`), kill2 (old ranks that SIGKILL themselves after
    the first eviction's forwards: the others evict again, "after3"), packed (bf16 weights
    packed for the k order: the layer holds no pack, "held" says so, and rebuilds it)."""
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep.layer import eviction
    from moe_ep.placement_weights import slice_weights

    torch.set_num_threads(1)
    mode = plan["mode"]
    placement = two_copies(world_size) if mode == "replicate" else None
    layout = placement or Placement.contiguous(E, world_size)
    p = problem(rank)
    layer = MoEEpLayer(
        BootstrapConfig(
            world_size, rank, timeout_s=TIMEOUT_S, external_store=bool(plan.get("external"))
        ),
        FleetParams(E, T, H, placement=placement),
        slice_weights(MoEWeightPack(p["w13"], p["w2"]), layout, rank),
        _backend(bool(plan.get("packed"))),
        eviction=plan.get("mode_of", {}).get(rank, mode),
        auto_evict=bool(plan.get("auto")),
    )
    out: dict[str, Any] = {"rank": rank, "held": layer._weights is not None}
    tensors = MoEEpTensors(p["x"], p["ids"], p["w"])
    out["before"] = to_wire(layer(tensors))
    # the same tokens with the weights of the experts on the doomed ranks zeroed: what mask
    # mode must give after losing them (0 * y adds nothing to the fp32 slot sum)
    doomed = set(plan.get("kill", [])) | set(plan.get("stop", []))
    lost = [
        e for e in range(E) if all(layout.rank_of_slot(s) in doomed for s in layout.replicas[e])
    ]
    zeroed = p["w"].masked_fill(torch.isin(p["ids"], torch.tensor(lost, dtype=torch.long)), 0.0)
    out["zeroed"] = to_wire(layer(MoEEpTensors(p["x"], p["ids"], zeroed)))
    pids = layer._runtime.gather_json(os.getpid(), what="test pids")
    if rank in plan.get("kill", []):
        os.kill(os.getpid(), signal.SIGKILL)
    if rank in plan.get("stop", []):
        # stopped by itself, past the pid gather: a SIGSTOP from rank 0 could land while this
        # rank was still inside that gather, which then timed out here after the resume
        os.kill(os.getpid(), signal.SIGSTOP)
    if plan.get("auto") and rank in plan.get("die_in_evict", []):
        _die_in_eviction(eviction)  # the eviction happens inside forward 2
    try:
        out["forward2"] = to_wire(layer(tensors))
    except Exception as exc:  # the verdict
        out["verdict"] = _error(exc)
        out["t_verdict"] = time.monotonic()
    if rank in plan.get("stop", []):  # resumed after the survivors evicted it: calls in again
        for failed in (out.get("verdict", {}).get("failed_ranks", []), []):
            try:
                layer.evict(failed)
                out.setdefault("rejoin", []).append("accepted")
            except Exception as exc:
                out.setdefault("rejoin", []).append(_error(exc)["error"])
        try:
            layer(tensors)
            out["rejoin_forward"] = "accepted"
        except Exception as exc:
            out["rejoin_forward"] = _error(exc)["error"]
        layer.destroy()
        return out
    if plan.get("auto"):
        out["new_rank"], out["new_world"] = layer.rank, layer.world_size
        if plan.get("kill2"):
            _second_kill(layer, tensors, rank, plan, out)
        layer.destroy()
        return out
    if rank in plan.get("die_in_evict", []):
        _die_in_eviction(eviction)
    failed = out["verdict"]["failed_ranks"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for attempt in range(2):
            try:
                out.setdefault("survivors", []).append(layer.evict(failed))
                break
            except Exception as exc:  # a failure during the eviction: its verdict
                out.setdefault("evict_errors", []).append(_error(exc))
                failed = out["evict_errors"][-1]["failed_ranks"]
                if attempt or not out["evict_errors"][-1]["error"].startswith(
                    ("MoeEpPeerError", "MoeEpTimeoutError")
                ):
                    try:  # a refused or disagreeing eviction: is the layer still served?
                        layer(tensors)
                        out["after_refusal"] = "served"
                    except Exception as again:
                        out["after_refusal"] = _error(again)["error"]
                    layer.destroy()
                    return out
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    out["after"] = to_wire(layer(tensors))
    out["held_after"] = layer._weights is not None
    out["t_serving"] = time.monotonic()
    out["new_rank"], out["new_world"] = layer.rank, layer.world_size
    if rank == 0:
        for r in plan.get("stop", []):
            os.kill(pids[r], signal.SIGCONT)
    out["after2"] = to_wire(layer(tensors))
    if plan.get("kill2"):
        _second_kill(layer, tensors, rank, plan, out)
    if plan.get("stop"):
        time.sleep(2.0)  # the resumed rank reads its verdict from rank 0's store
    t0 = time.monotonic()
    layer.destroy()
    out["destroy_s"] = time.monotonic() - t0
    return out

"""The fault matrix of issue #13: peer faults at every stage, every survivor bounded.

Each scenario runs the bf16 portable layer on `world_size` local ranks (the group moe-ep
creates, or a host's gloo group made with gloo's default 30-minute timeout) and makes the
victim rank(s) fault at one stage: SIGKILL or SIGSTOP of one or two ranks (the store's host,
rank 0, or not), or bad input on one rank. Stages: bootstrap (right after the victim hosts
or joins the store), the setup gather, the construction barrier, a forward's dispatch or
combine (its third forward), teardown (`destroy`). For every scenario:

- every survivor raises within `TIMEOUT_S + SLACK_S` (+ `SCHEDULING_S` for this loaded
  machine), the same class with the same `failed_ranks` (the victims; just the store's
  host when it is among them: without the store nothing else can be agreed); timed from
  the call that waits (the forward, `destroy`, or the entry into the faulted construction
  stage: the bootstrap before a gather or barrier fault is work, not waiting);
- bad input is named (rank and reason) to the peers in well under a second;
- afterwards a forward and a new layer raise at once (the group is gone) and `destroy()` is
  local and quick;
- every forward that completed is bit-identical to the same problem run at world size 1
  (the portable bf16 path is bit-identical across world sizes, docs/layer.md).

The default run keeps a few fast scenarios; `-m slow` runs them all (~150). Times are
recorded in docs/runtime.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from moe_ep import BootstrapConfig
from moe_ep.spawn import launch_local

pytestmark = pytest.mark.multirank

TIMEOUT_S = 4.0
GRACE_S = min(1.0, 0.25 * TIMEOUT_S + 0.25)  # moe_ep.runtime.bounded.grace_s
SLACK_S = 2 * GRACE_S  # the documented slack over timeout_s
SCHEDULING_S = 1.5  # process scheduling on a loaded 2-core machine
BOUND_S = TIMEOUT_S + SLACK_S + SCHEDULING_S
AT_ONCE_S = 0.5  # "at once": no wait, no collective
E, T, H, I, K = 8, 12, 128, 128, 2  # noqa: E741 - I is the glossary name
KERNEL = "any_bf16_bf16_bf16_torch"
FORWARDS = 3
FAULT_FORWARD = 3  # dispatch / combine faults and bad input hit this forward (1-based)
STAGES = ("bootstrap", "gather", "barrier", "dispatch", "combine", "teardown")


@dataclass(frozen=True)
class Scenario:
    world_size: int
    victims: tuple[int, ...]
    fault: str  # "KILL", "STOP" or "bad-input"
    stage: str  # one of STAGES ("dispatch" for bad input: raised before it)
    host_group: bool

    @property
    def id(self) -> str:
        group = "hostgroup" if self.host_group else "owngroup"
        who = "+".join(map(str, self.victims))
        return f"ep{self.world_size}-{group}-{self.fault}-r{who}-{self.stage}"

    @property
    def dies(self) -> bool:
        return self.fault in ("KILL", "STOP")

    @property
    def live(self) -> list[int]:
        """Ranks that run to the end (a rank with bad input does)."""
        return [r for r in range(self.world_size) if r not in self.victims or not self.dies]

    @property
    def expected(self) -> tuple[int, ...] | None:
        """The failed ranks every survivor must name; None: no survivor sees a fault (a
        host's group is never torn down by moe-ep, so its teardown waits on nobody)."""
        if self.host_group and self.stage == "teardown" and self.dies:
            return None
        return (0,) if 0 in self.victims and self.dies else self.victims


def _all_scenarios() -> list[Scenario]:
    out = []
    for ws, victim_sets in ((2, [(1,), (0,)]), (4, [(2,), (0,), (1, 2), (0, 2)])):
        for host_group in (False, True):
            for victims in victim_sets:
                for fault in ("KILL", "STOP"):
                    for stage in STAGES:
                        out.append(Scenario(ws, victims, fault, stage, host_group))
            for victim in ((1,), (0,)):
                out.append(Scenario(ws, victim, "bad-input", "dispatch", host_group))
    return out


FAST = {
    Scenario(2, (0,), "STOP", "barrier", False),  # frozen store host, construction barrier
    Scenario(2, (1,), "STOP", "dispatch", False),  # destroy() after a timed-out forward
    Scenario(2, (0,), "KILL", "combine", False),
    Scenario(2, (1,), "STOP", "combine", True),  # host gloo group, default timeout
    Scenario(2, (1,), "bad-input", "dispatch", True),
    Scenario(2, (0,), "bad-input", "dispatch", False),  # the store's host raised
    Scenario(4, (0, 2), "STOP", "gather", False),
    Scenario(4, (1,), "bad-input", "dispatch", True),
}


def _params() -> list[Any]:
    return [
        pytest.param(sc, id=sc.id, marks=() if sc in FAST else pytest.mark.slow)
        for sc in _all_scenarios()
    ]


# ------------------------------------------------------------------ the problem


def _expert_weights(e: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + e)
    w13 = (torch.randn(2 * I, H, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(H, I, generator=g) / I**0.5).bfloat16()
    return w13, w2


def _weights(first: int, count: int) -> Any:
    from moe_ep import MoEWeightPack

    parts = [_expert_weights(e) for e in range(first, first + count)]
    return MoEWeightPack(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))


def _tensors(rank: int, call: int, bad: bool = False) -> Any:
    from moe_ep import MoEEpTensors

    g = torch.Generator().manual_seed(rank * 100 + call)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if bad:
        ids[T // 2, 0] = E + 3
    return MoEEpTensors(x, ids, torch.rand(T, K, generator=g))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# ------------------------------------------------------------------ ranks


def _fire(fault: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL if fault == "KILL" else signal.SIGSTOP)


def _install_fault(sc: Scenario) -> None:
    """Make this (victim) process fault at its stage, by wrapping the call that starts it."""
    from moe_ep.backends.portable import comm
    from moe_ep.layer import layer as layer_module
    from moe_ep.runtime import bootstrap, handle

    def at_entry(owner: Any, name: str) -> None:
        real = getattr(owner, name)

        def hooked(*args: Any, **kwargs: Any) -> Any:
            _fire(sc.fault)
            return real(*args, **kwargs)

        setattr(owner, name, hooked)

    if sc.stage == "bootstrap":  # just after hosting / joining the store
        name = "host_store" if sc.host_group else "create_store"
        real = getattr(bootstrap, name)

        def joined(*args: Any, **kwargs: Any) -> Any:
            made = real(*args, **kwargs)
            _fire(sc.fault)
            return made

        setattr(bootstrap, name, joined)
    elif sc.stage == "gather":
        at_entry(handle.Runtime, "gather_json")
    elif sc.stage == "barrier":
        at_entry(handle.Runtime, "barrier")
    elif sc.stage == "teardown":
        at_entry(layer_module.MoEEpLayer, "destroy")
    else:
        what = "dispatch payload" if sc.stage == "dispatch" else "combine"
        real_a2a = comm._a2a
        seen = [0]

        def a2a(*args: Any) -> Any:
            if args[5] == what:
                seen[0] += 1
                if seen[0] == FAULT_FORWARD:
                    _fire(sc.fault)
            return real_a2a(*args)  # the received rows

        comm._a2a = a2a  # type: ignore[assignment]


_ENTERED: list[float] = []  # when this rank entered the scenario's construction stage


def _mark_stage_entry(sc: Scenario) -> None:
    """On every rank, note when the construction stage the victim faults in (the setup
    gather or the barrier) is entered: a survivor's wait is timed from there, not from the
    start of the construction (whose bootstrap takes seconds at EP4 on two cores)."""
    from moe_ep.runtime import handle

    name = {"gather": "gather_json", "barrier": "barrier"}.get(sc.stage)
    if name is None:
        return
    real = getattr(handle.Runtime, name)

    def entered(*args: Any, **kwargs: Any) -> Any:
        if not _ENTERED:
            _ENTERED.append(time.monotonic())
        return real(*args, **kwargs)

    setattr(handle.Runtime, name, entered)


def _step(out: dict[str, Any], name: str, fn: Any) -> tuple[bool, Any]:
    start = time.monotonic()
    _ENTERED.clear()
    try:
        value = fn()
        out["steps"].append({"step": name, "kind": "ok", "elapsed": time.monotonic() - start})
        return True, value
    except Exception as exc:
        out["steps"].append(
            {
                "step": name,
                "kind": type(exc).__name__,
                "elapsed": time.monotonic() - (_ENTERED[0] if _ENTERED else start),
                "failed_ranks": getattr(exc, "failed_ranks", None),
                "reasons": getattr(exc, "reasons", None),
                "message": str(exc),
            }
        )
        return False, None


def _matrix_worker(rank: int, world_size: int, sc: Scenario | None, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    from moe_ep import FleetParams, MoEEpLayer

    torch.set_num_threads(1)
    Path(tmp, f"pid{rank}").write_text(str(os.getpid()))
    host_group = sc is not None and sc.host_group
    if host_group:
        dist.init_process_group("gloo")  # gloo's default timeout: 30 minutes
    victim = sc is not None and rank in sc.victims
    if sc is not None:
        _mark_stage_entry(sc)
    if victim and sc is not None and sc.dies:
        _install_fault(sc)
    cfg = BootstrapConfig(
        world_size,
        rank,
        timeout_s=TIMEOUT_S,
        process_group=dist.group.WORLD if host_group else None,
    )
    e_local = E // world_size

    def build() -> Any:
        return MoEEpLayer(cfg, FleetParams(E, T, H), _weights(rank * e_local, e_local), KERNEL)

    out: dict[str, Any] = {"steps": [], "digests": {}}
    ok, layer = _step(out, "construct", build)
    call = 0
    while ok and call < FORWARDS:
        call += 1
        bad = victim and sc is not None and sc.fault == "bad-input" and call == FAULT_FORWARD
        tensors = _tensors(rank, call, bad)
        ok, y = _step(out, f"forward {call}", lambda t=tensors: layer(t))
        if ok:
            out["digests"][call] = _digest(y)
    if ok:
        ok, _ = _step(out, "destroy", layer.destroy)
    elif layer is not None:  # the group is gone: later calls raise at once, destroy is local
        _step(out, "later forward", lambda: layer(_tensors(rank, 99)))
        _step(out, "new layer", build)
        _step(out, "destroy after failure", layer.destroy)
    # stay (with the store) until every live rank is done, then end the stopped ones
    live = range(world_size) if sc is None else sc.live
    Path(tmp, f"done{rank}").touch()
    end = time.monotonic() + 60
    while not all(Path(tmp, f"done{r}").exists() for r in live) and time.monotonic() < end:
        time.sleep(0.02)
    if sc is not None and sc.dies:
        for r in sc.victims:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(Path(tmp, f"pid{r}").read_text()), signal.SIGKILL)
    if host_group and ok:
        dist.destroy_process_group()
    return out


# ------------------------------------------------------------------ reference


@pytest.fixture(scope="module")
def reference() -> dict[int, dict[int, list[str]]]:
    """world size -> rank -> digest of each forward's output, from one world-size-1 layer
    over every rank's tokens (bit-identical across world sizes)."""
    from moe_ep import FleetParams, MoEEpLayer, MoEEpTensors

    out: dict[int, dict[int, list[str]]] = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(name, raising=False)
        for ws in (2, 4):
            layer = MoEEpLayer(
                BootstrapConfig(1, 0, timeout_s=30),
                FleetParams(E, ws * T, H),
                _weights(0, E),
                KERNEL,
            )
            out[ws] = {r: [] for r in range(ws)}
            for call in range(1, FORWARDS + 1):
                parts = [_tensors(r, call) for r in range(ws)]
                y = layer(
                    MoEEpTensors(
                        torch.cat([p.hidden_states for p in parts]),
                        torch.cat([p.topk_ids for p in parts]),
                        torch.cat([p.topk_weights for p in parts]),
                    )
                )
                for r in range(ws):
                    out[ws][r].append(_digest(y[r * T : (r + 1) * T]))
            layer.destroy()
    return out


def _run(world_size: int, sc: Scenario | None, tmp: Path) -> Any:
    return launch_local(_matrix_worker, world_size, sc, str(tmp), timeout_s=90, failure_grace_s=60)


def _messages(run: Any, ranks: list[int]) -> str:
    """Every given rank's steps, in full (for a failing assertion)."""
    lines = []
    for rank in ranks:
        for s in run.results.get(rank, {"steps": []})["steps"]:
            lines.append(
                f"rank {rank} {s['step']}: {s['kind']} {s['elapsed']:.3f} s {s.get('message', '')}"
            )
    return "\n".join(lines)


def _check_forwards(out: dict[str, Any], expected: list[str]) -> None:
    for call, digest in out["digests"].items():
        assert digest == expected[call - 1], f"forward {call} differs from world size 1"


@pytest.mark.parametrize("world_size", [2, 4])
def test_clean_run_matches_world_size_1(
    world_size: int, reference: dict[int, dict[int, list[str]]], tmp_path: Path
) -> None:
    run = _run(world_size, None, tmp_path)
    assert run.ok, run.error()
    for rank, out in run.results.items():
        assert [s["kind"] for s in out["steps"]] == ["ok"] * (FORWARDS + 2), out
        assert len(out["digests"]) == FORWARDS
        _check_forwards(out, reference[world_size][rank])


@pytest.mark.parametrize("sc", _params())
def test_fault(sc: Scenario, reference: dict[int, dict[int, list[str]]], tmp_path: Path) -> None:
    run = _run(sc.world_size, sc, tmp_path)
    survivors = [r for r in range(sc.world_size) if r not in sc.victims]
    assert sorted(run.results) == sc.live, run.error()
    failures: dict[int, dict[str, Any]] = {}
    for rank in survivors:
        out = run.results[rank]
        _check_forwards(out, reference[sc.world_size][rank])
        failed = [s for s in out["steps"] if s["kind"] != "ok"]
        if sc.expected is None:
            assert not failed, (rank, out["steps"])
            continue
        assert failed, (rank, out["steps"])
        failures[rank] = first = failed[0]
        if sc.stage in ("dispatch", "combine"):  # the forward the fault was planted in
            assert first["step"] == f"forward {FAULT_FORWARD}", (rank, out["steps"])
    for rank, first in failures.items():
        seen = (rank, first, _messages(run, survivors))
        assert first["kind"] in ("MoeEpPeerError", "MoeEpTimeoutError"), seen
        assert first["failed_ranks"] == sc.expected, seen
        assert first["elapsed"] < BOUND_S, seen
        out = run.results[rank]
        failed = [s for s in out["steps"] if s["kind"] != "ok"]
        later = {s["step"]: s for s in failed[1:]}
        for name in ("later forward", "new layer"):
            if name in later:
                assert later[name]["kind"] == "MoeEpPeerError", later[name]
                assert later[name]["failed_ranks"] == sc.expected, later[name]
                assert later[name]["elapsed"] < AT_ONCE_S, later[name]
        for s in out["steps"]:
            if s["step"] == "destroy after failure":
                assert s["kind"] == "ok" and s["elapsed"] < GRACE_S + AT_ONCE_S, s
    kinds = {f["kind"] for f in failures.values()}
    assert len(kinds) <= 1, _messages(run, survivors)  # one verdict: the same class
    # one line per scenario for the table in docs/runtime.md (shown with `-s`)
    slowest = max((f["elapsed"] for f in failures.values()), default=0.0)
    print(f"\nMATRIX {sc.id} {'/'.join(sorted(kinds)) or 'none'} {slowest:.2f}")
    if sc.fault == "bad-input":
        victim = sc.victims[0]
        own = next(s for s in run.results[victim]["steps"] if s["kind"] != "ok")
        assert own["kind"] == "MoeEpUsageError" and "topk_ids" in own["message"], own
        for rank, first in failures.items():
            assert "MoeEpUsageError" in first["reasons"][victim], (rank, first)
            assert "topk_ids" in first["reasons"][victim], (rank, first)
            assert first["elapsed"] < AT_ONCE_S, (rank, first)  # told, not timed out

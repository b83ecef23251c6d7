"""The push kernel's peer checks: one node, distinct GPUs, NVLink-native atomics between
every pair of ranks, agreed on by all ranks before the first push collective.

Warning:
    The GPU queries (`local_report`, `p2p_problem`) have NEVER RUN ON A GPU. What is tested
    on CPU (`tests/backends/test_sm90_push_peers.py`): the agreement protocol over 2 spawned
    gloo ranks with those two queries faked (a rank without native atomics, a second host, a
    rank whose module build failed, the all-good case), through the kernel's `warmup()`.

The push protocol writes into peers' windows with system-scope atomics, which need NVLink
(PCIe peer access lacks native atomics), so the check mirrors the one FlashInfer's push
runner makes (`cudaDeviceGetP2PAttribute(cudaDevP2PAttrNativeAtomicSupported)` through the
drop's `sm90_push_p2p_native_atomics`, plus `can_device_access_peer`). The protocol: every
rank gathers every rank's `PeerReport` (host, device, GPU uuid, devices visible, any local
failure so far, e.g. the module build); failures and topology problems visible in the
reports are judged identically on every rank; then each rank probes its device against
every peer's, and the per-rank verdicts are gathered too. Any problem anywhere raises the
same `MoeEpUnavailableError` (listing every problem with its rank) on every rank, so no rank
goes on alone into the window rendezvous, where it would wait for peers that never come.
Both gathers are bounded by the runtime's timeout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from moe_ep.errors import MoeEpUnavailableError

__all__ = ["PeerReport", "agree_on_peers", "local_report", "p2p_problem"]

_KERNEL = "sm90_fp8_fp8_bf16_push_cuda"

PeerProbe = Callable[[int, int], str | None]
"""`probe(device, peer_device)`: None when the pair can run the protocol, else why not."""


@dataclass(frozen=True)
class PeerReport:
    """One rank's facts for the peer check (JSON-able; gathered from every rank)."""

    host: str
    device: int
    """CUDA ordinal of this rank's device in its own process."""
    uuid: str
    """Physical GPU id ("" when unknown)."""
    visible_devices: int
    """CUDA devices this rank's process sees (peer ordinals beyond it cannot be probed)."""
    error: str = ""
    """A local failure before the check (module build, device query); "" if none."""


def local_report(device: Any) -> PeerReport:
    """This rank's `PeerReport` for CUDA `device` (GPU; never run). A MIG slice is reported
    as an error: the protocol needs whole-GPU peer mappings."""
    import socket

    import torch

    index = int(torch.device(device).index or 0)
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", ""))
    error = ""
    if "MIG" in props.name or uuid.startswith("MIG"):
        error = f"device {index} is a MIG slice ({props.name}); the push protocol needs a whole GPU"
    return PeerReport(socket.gethostname(), index, uuid, torch.cuda.device_count(), error)


def p2p_problem(a2a: Any, device: int, peer: int) -> str | None:
    """Can `device` run the push protocol with `peer`: peer access and NVLink-native atomics
    (the drop's `sm90_push_p2p_native_atomics`)? None if so, else why not (GPU; never run)."""
    import torch

    if not torch.cuda.can_device_access_peer(device, peer):
        return f"device {device} cannot access peer device {peer} (no CUDA peer access)"
    if not bool(a2a.sm90_push_p2p_native_atomics(device, peer)):
        return (
            f"no NVLink-native system-scope atomics between device {device} and peer device "
            f"{peer} (PCIe-only peer access cannot run the push protocol)"
        )
    return None


def _topology_problems(reports: list[PeerReport]) -> list[str]:
    """What every rank can judge from the gathered reports alone (same result everywhere)."""
    problems = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error]
    hosts = sorted({rep.host for rep in reports})
    if len(hosts) > 1:
        where = ", ".join(f"rank {r} on {rep.host!r}" for r, rep in enumerate(reports))
        problems.append(f"the EP group spans {len(hosts)} hosts ({where}); one node only")
    seen: dict[str, int] = {}
    for r, rep in enumerate(reports):
        if rep.uuid and rep.uuid in seen:
            problems.append(
                f"ranks {seen[rep.uuid]} and {r} use the same GPU ({rep.uuid}); the push "
                "protocol needs one GPU per rank"
            )
        seen.setdefault(rep.uuid, r)
    return problems


def _pair_problems(reports: list[PeerReport], rank: int, probe: PeerProbe) -> list[str]:
    """This rank's device against every peer's (only this rank can query its own pairs)."""
    me, problems = reports[rank], []
    for peer, rep in enumerate(reports):
        if peer == rank:
            continue
        if rep.device == me.device or rep.device >= me.visible_devices:
            problems.append(
                f"rank {rank} (device {me.device}) cannot probe peer rank {peer}: its device "
                f"ordinal {rep.device} does not name that GPU in rank {rank}'s process "
                "(per-rank CUDA_VISIBLE_DEVICES?); expose every EP GPU to every rank"
            )
            continue
        try:
            why = probe(me.device, rep.device)
        except Exception as exc:
            why = f"peer query failed: {type(exc).__name__}: {exc}"
        if why:
            problems.append(f"rank {rank} -> peer rank {peer}: {why}")
    return problems


def agree_on_peers(
    runtime: Any,
    local: PeerReport,
    probe: PeerProbe,
    *,
    local_exc: BaseException | None = None,
) -> None:
    """Collective: return on every rank, or raise the same error on every rank.

    Args:
        runtime: the `moe_ep.runtime.Runtime` (its `rank` and bounded `gather_json`).
        local: this rank's report; a non-empty `error` fails the check for everyone.
        probe: this rank's pair query (`p2p_problem` bound to the loaded a2a module).
        local_exc: the exception behind `local.error`, chained on this rank.

    Raises:
        MoeEpUnavailableError: any rank has a problem; the message lists each, by rank.
        MoeEpTimeoutError: a peer did not reach the check within the runtime's timeout.
    """
    what = f"{_KERNEL} peer check"
    reports = [PeerReport(**r) for r in runtime.gather_json(asdict(local), what=what)]
    problems = _topology_problems(reports)
    if not problems:
        mine = _pair_problems(reports, runtime.rank, probe)
        problems = [p for per_rank in runtime.gather_json(mine, what=what) for p in per_rank]
    if problems:
        raise MoeEpUnavailableError(
            f"{_KERNEL} cannot run on this EP group (seen from rank {runtime.rank} of "
            f"{len(reports)}; every rank raises this): " + "; ".join(problems)
        ) from local_exc

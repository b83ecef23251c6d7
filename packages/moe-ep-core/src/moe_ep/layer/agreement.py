"""The layer's construction-time check that every rank asked for the same layer.

Each rank validates its own arguments locally; what no rank can see alone is a peer that
passed different ones (another kernel or config, another `FleetParams`, other weight
shapes). The kernels size their buffers and exchanges from these, so a mismatch would hang
or corrupt the first forward. One bounded gather right after joining the group, before the
kernel allocates anything, compares them; every rank raises the same error.
"""

from __future__ import annotations

from typing import Any

from moe_ep.errors import MoeEpUsageError
from moe_ep.types import FleetParams, MoEWeightPack

__all__ = ["agree", "agree_on_setup", "setup_fingerprint"]


def setup_fingerprint(
    kernel_name: str, config: object, fleet: FleetParams, weights: MoEWeightPack
) -> dict[str, str]:
    """What must be equal on every rank, as printable strings."""
    return {
        "kernel": kernel_name,
        "config": repr(config),
        "fleet_params": repr(fleet),
        "w13 shape": str(list(weights.w13.shape)),
        "w2 shape": str(list(weights.w2.shape)),
        "pre-quantized": str(weights.prequantized),
    }


def agree_on_setup(runtime: Any, mine: dict[str, str]) -> None:
    """Collective: gather every rank's fingerprint; raise on every rank if any differ.

    Raises:
        MoeEpUsageError: names each field that differs and which ranks hold which value.
        MoeEpTimeoutError: a rank did not reach the check within the runtime's timeout.
    """
    agree(runtime, mine, subject="layers", what="moe-ep layer setup check")


def agree(runtime: Any, mine: dict[str, str], *, subject: str, what: str) -> None:
    """Collective: one bounded gather of every rank's `mine`; `MoeEpUsageError` on every
    rank (the same text) if any field differs, naming the ranks holding each value."""
    everyone: list[dict[str, str]] = runtime.gather_json(mine, what=what)
    problems = []
    for key in mine:
        holders: dict[str, list[int]] = {}
        for rank, fingerprint in enumerate(everyone):
            holders.setdefault(fingerprint.get(key, "(missing)"), []).append(rank)
        if len(holders) > 1:
            problems.append(
                f"{key}: "
                + "; ".join(f"rank(s) {ranks} {value}" for value, ranks in holders.items())
            )
    if problems:
        raise MoeEpUsageError(
            f"the EP ranks asked for different {subject} (seen from rank {runtime.rank} of "
            f"{len(everyone)}; every rank raises this): " + " | ".join(problems)
        )

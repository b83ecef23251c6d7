"""Transitional: removed in the portable-seam step (the process spawner is `moe_ep.spawn`)."""

from moe_ep.spawn import STOP_GRACE_S, LocalRun, RankFailure, free_port, launch_local, spawn_local

__all__ = ["STOP_GRACE_S", "LocalRun", "RankFailure", "free_port", "launch_local", "spawn_local"]

"""`WorkspacePool`, kept importable here: it lives in `moe_ep.backends.support.pool`."""

from __future__ import annotations

from moe_ep.backends.support.pool import WorkspacePool

__all__ = ["WorkspacePool"]

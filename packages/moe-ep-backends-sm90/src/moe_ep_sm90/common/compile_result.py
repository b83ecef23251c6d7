"""`CompileResult`: what a compile-only check of an sm90 kernel reports."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CompileResult"]


@dataclass(frozen=True)
class CompileResult:
    kernel: str
    arch: str
    seconds: float
    detail: str = ""

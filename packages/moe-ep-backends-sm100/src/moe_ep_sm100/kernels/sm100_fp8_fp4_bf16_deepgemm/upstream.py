"""The slice of DeepGEMM's Python API the deepgemm mega-MoE wrapper is written against.

DeepGEMM (github.com/deepseek-ai/DeepGEMM) introduced its Blackwell mega-MoE in the public
release of 2026-04 (pull request #304: "Only FP8 x FP4 MoE is supported", "Requires PyTorch
>= 2.9"). The wrapper uses only the part of its API that is the same in every version read
(see docs/backends.md for the files and commits):

- `deep_gemm.get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank,
  num_topk, hidden, intermediate_hidden)` -> a `SymmBuffer` (torch symmetric memory over
  `group`, rendezvous + barrier inside: collective) with input views `x`, `x_sf`,
  `topk_idx`, `topk_weights`, `num_max_tokens_per_rank` (aligned up) and `destroy()`;
- `deep_gemm.fp8_fp4_mega_moe(y, l1_weights, l2_weights, sym_buffer, *, recipe, activation,
  activation_clamp, fast_math)`, the fused dispatch + FC1 + SwiGLU + FC2 + combine into
  `y [n, H]` bf16, where n = `y.shape[0]` live rows of the staged inputs.

Nothing here imports `deep_gemm` at module load; `load_deep_gemm()` does, and only the
launch path and `availability()` (after the GPU check passed) call it.
"""

from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any

from moe_ep.backends.support.availability import cuda_capability_reason, missing_packages

__all__ = [
    "INSTALL_HINT",
    "MIN_TORCH",
    "REQUIRED_API",
    "api_mismatch",
    "deepgemm_availability",
    "load_deep_gemm",
    "torch_version_reason",
]

INSTALL_HINT = (
    "build DeepGEMM (public release 2026-04 or later, with its sm100 mega-MoE) from "
    "github.com/deepseek-ai/DeepGEMM; the PyPI `deep-gemm` 1.0.0 is an unrelated early "
    "Hopper-only FP8 GEMM"
)
_PACKAGE = (("deep_gemm", "deep_gemm"),)

MIN_TORCH = (2, 9)
"""DeepGEMM's mega-MoE allocates with `torch.distributed._symmetric_memory` (needs 2.9+)."""

REQUIRED_API: dict[str, tuple[str, ...]] = {
    "get_symm_buffer_for_mega_moe": (
        "group",
        "num_experts",
        "num_max_tokens_per_rank",
        "num_topk",
        "hidden",
        "intermediate_hidden",
    ),
    "fp8_fp4_mega_moe": (
        "y",
        "l1_weights",
        "l2_weights",
        "sym_buffer",
        "recipe",
        "activation",
        "activation_clamp",
        "fast_math",
    ),
}
"""Function name -> parameter names it must take (the wrapper passes them all by keyword)."""


def load_deep_gemm() -> ModuleType:
    """`import deep_gemm` (initialises its JIT; needs the CUDA toolkit it was built with)."""
    return importlib.import_module("deep_gemm")


def _version(module: Any) -> str:
    return str(getattr(module, "__version__", "unknown"))


def api_mismatch(module: Any) -> str:
    """ "" if `module` has `REQUIRED_API`, else what differs (names the installed version)."""
    problems = []
    for name, params in REQUIRED_API.items():
        fn = getattr(module, name, None)
        if not callable(fn):
            problems.append(f"no function {name}")
            continue
        try:
            have = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            problems.append(f"{name} has no inspectable signature")
            continue
        missing = [p for p in params if p not in have]
        if missing:
            problems.append(f"{name} lacks parameter(s) {', '.join(missing)}")
    if not problems:
        return ""
    return (
        f"deep_gemm {_version(module)} does not have the mega-MoE API this wrapper was written "
        f"against ({'; '.join(problems)}); {INSTALL_HINT}"
    )


def torch_version_reason() -> str:
    """ "" if torch is at least `MIN_TORCH`, else why not."""
    import torch

    parts = torch.__version__.split("+")[0].split(".")
    try:
        have = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return ""
    if have < MIN_TORCH:
        return (
            f"torch {torch.__version__} is too old: DeepGEMM's mega-MoE needs torch >= "
            f"{MIN_TORCH[0]}.{MIN_TORCH[1]} (torch.distributed._symmetric_memory)"
        )
    return ""


def deepgemm_availability() -> tuple[bool, str]:
    """(True, "") or (False, every reason): the package, the GPU, torch, then the API.

    `deep_gemm` is imported only once the package is found and a compute capability 10.0
    device is visible (importing it initialises its JIT against the local toolkit).
    """
    reasons = [f"{why} ({INSTALL_HINT})" for why in missing_packages(_PACKAGE)]
    gpu = cuda_capability_reason((10, 0), "Blackwell B200/GB200, sm_100a")
    if gpu:
        reasons.append(gpu)
    old = torch_version_reason()
    if old:
        reasons.append(old)
    if not reasons:
        try:
            module = load_deep_gemm()
        except Exception as exc:  # a broken build is a reason, not a crash
            reasons.append(f"import deep_gemm failed: {type(exc).__name__}: {exc}")
        else:
            mismatch = api_mismatch(module)
            if mismatch:
                reasons.append(mismatch)
    return (not reasons, "; ".join(reasons))

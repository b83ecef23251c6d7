"""flashinfer-python 0.7.4's `flashinfer.moe_ep.MoEEpLayer(bootstrap, fleet_params, weights,
fleet_knobs=(), backend=...)` arguments, read as moe-ep's (docs/runtime.md, "Hosts written
against flashinfer.moe_ep")."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moe_ep.contract import KernelConfig
from moe_ep.errors import MoeEpUsageError

__all__ = ["layer_backend"]

_MEGA_DEFAULTS = (("quantize_input", True), ("preprocess_weights", True))


def layer_backend(fleet_knobs: Sequence[object] | KernelConfig, backend: object) -> Any:
    """The `backend` `MoEEpLayer` resolves, from its 4th and 5th arguments (its type is
    `resolve_backend`'s to check).

    - moe-ep's own order, the backend as 4th positional: anything but a sequence (a kernel
      name counts as one) is taken as the backend.
    - flashinfer's: `fleet_knobs`, a sequence, must be empty (its transport knobs configure
      the split dispatch/combine path, which moe-ep does not have); `backend` is a kernel
      name, a config, or an object with flashinfer's `MegaConfig` fields, whose
      `megakernel` is used when `quantize_input` and `preprocess_weights` are True and
      `transformed_weights` is None (the only mode moe-ep has).

    Raises:
        MoeEpUsageError: knobs given, the backend given twice or not at all, or a
            `MegaConfig` field moe-ep cannot honour (named).
    """
    if isinstance(fleet_knobs, str) or not isinstance(fleet_knobs, Sequence):
        if backend is not None:
            raise MoeEpUsageError(
                f"MoEEpLayer got the backend twice: {fleet_knobs!r} as the 4th positional "
                f"argument (moe-ep's order) and backend={backend!r}; pass one"
            )
        return fleet_knobs
    if len(fleet_knobs):
        raise MoeEpUsageError(
            f"MoEEpLayer fleet_knobs must be empty, got {fleet_knobs!r}: flashinfer's fleet "
            "knobs configure its split (dispatch/combine) transport; moe-ep runs fused kernels "
            "only"
        )
    if backend is None:
        raise MoeEpUsageError(
            "MoEEpLayer needs backend=: a kernel name (e.g. 'any_bf16_bf16_bf16_torch'), a "
            "kernel config object, or a MegaConfig(megakernel=<one of those>)"
        )
    if isinstance(backend, str | KernelConfig) or not hasattr(backend, "megakernel"):
        return backend
    for name, honoured in _MEGA_DEFAULTS:
        if getattr(backend, name, honoured) is not honoured:
            raise MoeEpUsageError(
                f"MegaConfig.{name}={getattr(backend, name)!r} is not supported: moe-ep takes "
                f"bf16 hidden states and prepares the weight pack itself ({name}={honoured})"
            )
    if getattr(backend, "transformed_weights", None) is not None:
        raise MoeEpUsageError(
            "MegaConfig.transformed_weights must be None: moe-ep prepares the weight pack "
            "itself (kernel-ready payloads are not accepted)"
        )
    return backend.megakernel

"""The layer's lookup at construction: the cached winner's knobs on the default config."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from moe_ep.contract import KernelConfig
from moe_ep.errors import MoeEpUsageError
from moe_ep.tuning.cache import (
    TuningCache,
    TuningCacheWarning,
    TuningKey,
    arch_of,
    cache_path,
    tokens_bucket,
    versions,
)
from moe_ep.tuning.knobs import from_json, grid_of


def key_for(
    kernel_cls: type, tokens: int, hidden: int, inter: int, experts: int, world_size: int,
    cuda_ordinal: int | None,
) -> TuningKey:  # fmt: skip
    """The cache key of a kernel on a problem (tokens per rank, H, I, E) at a world size."""
    return TuningKey(
        kernel=str(getattr(kernel_cls, "kernel_name", kernel_cls.__name__)),
        arch=arch_of(cuda_ordinal),
        bucket=(tokens_bucket(tokens), hidden, inter, experts),
        world_size=world_size,
        versions=versions(kernel_cls.__module__),
    )


def apply_knobs(config: KernelConfig, knobs: dict[str, Any]) -> KernelConfig:
    """`config` with `knobs` replaced (JSON values converted back), checked by the config
    class; only the kernel's declared knobs may be set.

    Raises:
        MoeEpUsageError: a field that is not a declared knob, or a value the config refuses.
    """
    grid = grid_of(config.kernel_name)
    extra = sorted(set(knobs) - set(grid))
    if extra:
        raise MoeEpUsageError(
            f"{config.kernel_name}: {extra} are not tuning knobs (knobs: {sorted(grid)})"
        )
    return dataclasses.replace(config, **{k: from_json(v) for k, v in knobs.items()})


def tuned_config(
    kernel_cls: Any, config: KernelConfig, tokens: int, hidden: int, inter: int, experts: int,
    world_size: int, cuda_ordinal: int | None,
) -> KernelConfig:  # fmt: skip
    """`config` (the kernel's default) with the winner cached for this problem, or `config`
    itself when there is none, or when the entry is corrupted, stale or refused by the
    config class (each reported by a `TuningCacheWarning`)."""
    path = cache_path()
    if not path.is_file():
        return config
    key = key_for(kernel_cls, tokens, hidden, inter, experts, world_size, cuda_ordinal)
    knobs = TuningCache(path).lookup(key)
    if knobs is None:
        return config
    try:
        return apply_knobs(config, knobs)
    except (MoeEpUsageError, TypeError) as exc:
        warnings.warn(
            f"tuning cache: entry {key.ident()!r} of {path} is refused ({exc}): ignored "
            "(defaults used)",
            TuningCacheWarning,
            stacklevel=2,
        )
        return config


def layer_config(
    kernel_cls: Any, config: KernelConfig, fleet: Any, weights: Any, shape: Any, bootstrap: Any
) -> tuple[KernelConfig, Any]:
    """The layer's hook (a layer built from a kernel name, before any collective): the
    tuned config and the weight pack's `PackShape` checked under it; the default config and
    `shape` when nothing usable is cached. A cached config the weights do not fit is
    reported and ignored."""
    from moe_ep.device import resolve_local_device

    tuned = tuned_config(
        kernel_cls, config, fleet.max_tokens_per_rank, shape.hidden_size,
        shape.intermediate_size, fleet.num_experts, bootstrap.world_size,
        resolve_local_device(bootstrap),
    )  # fmt: skip
    if tuned is config:
        return config, shape
    try:
        return tuned, kernel_cls.validate_weights(weights, fleet, bootstrap.world_size, tuned)
    except MoeEpUsageError as exc:
        warnings.warn(
            f"tuning cache: the cached config {tuned} does not fit these weights ({exc}): "
            "ignored (defaults used)",
            TuningCacheWarning,
            stacklevel=2,
        )
        return config, shape

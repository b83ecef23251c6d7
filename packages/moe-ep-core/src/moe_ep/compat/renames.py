"""One option, two names: pick the value given under either, refuse a contradiction.

Used where moe-ep accepts flashinfer 0.7.4's name for one of its own options (both kept,
e.g. `FleetParams.hidden_size` / `token_hidden_size`) or renamed an option and keeps the old
name as a deprecated alias (`PortableConfig.topk_weight_before_fc2`).
"""

from __future__ import annotations

import warnings
from typing import TypeVar

from moe_ep.errors import MoeEpUsageError

__all__ = ["either_name"]

V = TypeVar("V")


def either_name(
    owner: str,
    name: str,
    value: V | None,
    other: str,
    other_value: V | None,
    *,
    default: V,
    deprecated: bool = False,
    stacklevel: int = 3,
) -> V:
    """The option's value given as `name` or as `other` (None = not given), else `default`.

    Args:
        owner: what the option belongs to, for messages (e.g. "FleetParams").
        name / value: the canonical name and what was passed under it.
        other / other_value: the second name and what was passed under it.
        deprecated: `other` is a deprecated alias: passing it warns (`DeprecationWarning`
            naming `name`), `stacklevel` frames above this function.

    Raises:
        MoeEpUsageError: both names were given with different values.
    """
    if other_value is None:
        return default if value is None else value
    if deprecated:
        warnings.warn(
            f"{owner}.{other} is deprecated; use {owner}.{name} (same meaning)",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    if value is not None and value != other_value:
        raise MoeEpUsageError(
            f"{owner}: {name}={value!r} and {other}={other_value!r} name the same option with "
            f"different values; pass one of them"
        )
    return other_value

"""`moe_ep.bench.targets`: the status column reads each target as docs/runbook.md writes it."""

from __future__ import annotations

import math

import pytest

from moe_ep.bench.targets import NA, OK, OVER, UNDER, Target, row_status, status

LAYER = Target("<=", 1.3, applies_to="prefill")
RATE = Target(">=", 0.80, unit="%")


@pytest.mark.parametrize(
    ("value", "target", "expected"),
    [
        (1.20, LAYER, OK),
        (1.30, LAYER, OK),  # the bound itself keeps "<="
        (1.31, LAYER, OVER),
        (1.30, Target("<", 1.3), OVER),  # ... but not "<"
        (0.87, RATE, OK),
        (0.80, RATE, OK),
        (0.79, RATE, UNDER),
        (1.0, Target(">", 1.0), UNDER),
        (1.01, Target(">", 1.0), OK),
        (5.0, None, NA),
        (None, LAYER, NA),
        (math.nan, LAYER, NA),
        (math.inf, LAYER, NA),
    ],
)
def test_status_against_the_bound(
    value: float | None, target: Target | None, expected: str
) -> None:
    assert status(value, target) == expected


def test_labels_and_values_in_the_docs_units() -> None:
    assert LAYER.label() == "<= 1.3x"
    assert Target("<=", 5.0).label() == "<= 5x"
    assert RATE.label() == ">= 80%"
    assert LAYER.fmt(1.234) == "1.23x"
    assert RATE.fmt(0.874) == "87%"


def test_a_bad_target_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Target\.op"):
        Target("=<", 1.3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"Target\.bound"):
        Target("<=", math.nan)


def test_row_status_names_what_missed() -> None:
    naive = Target(">", 1.0)
    assert row_status([("layer/dense", 1.2, LAYER), ("naive/layer", 1.4, naive)]) == OK
    assert row_status([("layer/dense", 2.9, None), ("eager", 0.5, None)]) == NA
    assert (
        row_status([("layer/dense", 1.4, LAYER), ("naive/layer", 1.4, naive)])
        == "over target: layer/dense"
    )
    assert (
        row_status([("layer/dense", 1.4, LAYER), ("naive/layer", 0.9, naive), ("x", 9.0, None)])
        == "over target: layer/dense; under target: naive/layer"
    )

"""The exception classes are importable from `moe_ep` itself, and lazily (no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import moe_ep
import moe_ep.errors

ERRORS = (
    "MoeEpError",
    "MoeEpPeerError",
    "MoeEpTimeoutError",
    "MoeEpUnavailableError",
    "MoeEpUsageError",
)


def test_every_error_class_is_a_public_name_of_moe_ep() -> None:
    assert set(ERRORS) == set(moe_ep.errors.__all__)
    for name in ERRORS:
        assert name in moe_ep.__all__ and name in dir(moe_ep)
        assert getattr(moe_ep, name) is getattr(moe_ep.errors, name)
    from moe_ep import MoeEpUsageError

    assert issubclass(MoeEpUsageError, ValueError)


def test_importing_the_errors_from_moe_ep_loads_no_torch() -> None:
    code = (
        "import json, sys\n"
        "from moe_ep import MoeEpError, MoeEpPeerError, MoeEpTimeoutError, "
        "MoeEpUnavailableError, MoeEpUsageError\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'moe_ep'))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == ["moe_ep", "moe_ep.errors"], loaded

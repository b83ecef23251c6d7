"""Suite-wide set-up: the vendored drops are materialized and verified before any test runs.

Some tests need a drop's upstream `src/` (compile checks, layouts read from the drops, the
real drops' vendor tests). So that no outcome depends on test order or on an earlier run, the
session starts by syncing every drop whose `src/` is missing from its pin (the vendor tool's
`sync`, which fetches the pinned artifact once into `~/.cache/moe-ep-vendor`, or
`$MOE_EP_VENDOR_CACHE`) and verifying every materialized drop against its lock. This is the
one place the suite writes into the checkout (`vendor/*/src/`, git-ignored). When the source
cannot be reached (no network), the run goes on: every test that needs a drop skips with a
reason naming the sync command.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "tools") not in sys.path:
    sys.path.insert(0, str(REPO / "tools"))

from vendorlib import checks, ops  # noqa: E402
from vendorlib.drops import drop_names, load_drop  # noqa: E402
from vendorlib.errors import SourceError, VendorError  # noqa: E402
from vendorlib.progress import make_progress  # noqa: E402
from vendorlib.sources import cache_dir  # noqa: E402

SYNC_ALL = "uv run tools/vendor.py sync --all"


@dataclass
class DropsSetup:
    """What the session start did to the checkout's drops."""

    missing: list[str] = field(default_factory=list)  # no src/ when the session started
    sync_errors: dict[str, str] = field(default_factory=dict)
    unverified: dict[str, str] = field(default_factory=dict)  # present, but not as locked
    seconds: float = 0.0

    def outcome(self) -> str:
        """How the session start ended, for its progress line ("" when all was in place)."""
        parts = []
        synced = [n for n in self.missing if n not in self.sync_errors]
        if synced:
            parts.append(f"materialized {len(synced)} in {self.seconds:.1f} s")
        if self.sync_errors:
            first = next(iter(self.sync_errors.values()))
            parts.append(
                f"could not materialize {', '.join(self.sync_errors)} ({first}); the tests "
                f"that need them skip (run `{SYNC_ALL}` with network access)"
            )
        parts += [
            f"{name} does not match its lock ({why}; `uv run tools/vendor.py verify {name}`)"
            for name, why in self.unverified.items()
        ]
        return "; ".join(parts)


def _source_key(root: Path, name: str) -> str:
    pin = load_drop(root, name).meta.source
    return pin.fields.get("sha256") or pin.fields.get("url") or pin.fields.get("path", name)


def setup_drops(root: Path, announce: Callable[[str], None]) -> DropsSetup:
    """Sync every drop of `root` whose `src/` is missing, then verify every present one.

    `announce` gets one message before a sync starts. A source that cannot be reached is
    recorded, not raised: the tests that need the drop skip. A present `src/` is never
    rewritten (local edits are the developer's to resolve).
    """
    names = drop_names(root)
    done = DropsSetup(missing=[n for n in names if not (root / "vendor" / n / "src").exists()])
    if done.missing:
        announce(f"materializing {', '.join(done.missing)} (sources cached in {cache_dir()}) ...")
    start = time.monotonic()
    unreachable: dict[str, str] = {}  # source -> error: one wait per source (drops share one)
    for name in done.missing:
        source = _source_key(root, name)
        if source in unreachable:
            done.sync_errors[name] = unreachable[source]
            continue
        try:
            ops.sync(root, name, make_progress(True))
        except SourceError as exc:
            done.sync_errors[name] = unreachable[source] = str(exc)
        except (VendorError, OSError) as exc:  # OSError: a concurrent run swapped src/ in
            done.sync_errors[name] = str(exc)
    done.seconds = time.monotonic() - start
    for name in names:
        if not (root / "vendor" / name / "src").exists():
            continue
        result = checks.verify(root, name)
        if result["ok"]:
            done.sync_errors.pop(name, None)
        else:
            done.unverified[name] = ", ".join(
                f"{p['check']} {p['path']}" for p in result["problems"][:3]
            )
    return done


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def write(text: str) -> None:
        if reporter is not None:
            reporter.write(text, flush=True)
        else:
            sys.stderr.write(text)
            sys.stderr.flush()

    prefix = "moe-ep tests: vendored drops: "
    announced = False

    def announce(message: str) -> None:
        nonlocal announced
        announced = True
        write(prefix + message)

    outcome = setup_drops(REPO, announce).outcome()
    if outcome:
        write((" " if announced else prefix) + outcome + "\n")

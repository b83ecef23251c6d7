"""Units of the vendor tool: patches, globs, VENDOR.md round trip."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vendor_testlib import REPO
from vendorlib import ops
from vendorlib.errors import MismatchError, SourceError, UsageError
from vendorlib.globs import select
from vendorlib.meta import load_meta, parse_meta, render_meta
from vendorlib.patching import apply_patch, make_patch, reverse_patch

_lines = st.lists(st.sampled_from(["a", "b", "c", "", "def f():", "  x = 1"]), max_size=12)


def _text(lines: list[str], eol: bool) -> bytes:
    return ("\n".join(lines) + ("\n" if eol and lines else "")).encode()


@settings(max_examples=150, deadline=None)
@given(_lines, _lines, st.booleans(), st.booleans())
def test_patch_round_trip(a: list[str], b: list[str], eol_a: bool, eol_b: bool) -> None:
    old, new = _text(a, eol_a), _text(b, eol_b)
    patch = make_patch(old, new, "x.py")
    assert (patch == "") == (old == new)
    assert apply_patch(old, patch, "x.py") == new
    assert apply_patch(new, reverse_patch(patch), "x.py") == old


def test_patch_is_a_standard_unified_diff() -> None:
    old, new = b"a\nb\nc\n", b"a\nB\nc\nd\n"
    expected = "".join(
        difflib.unified_diff(
            old.decode().splitlines(True), new.decode().splitlines(True), "a/p", "b/p"
        )
    )
    assert make_patch(old, new, "p") == expected


def test_patch_refuses_wrong_context() -> None:
    patch = make_patch(b"a\nb\nc\n", b"a\nX\nc\n", "p")
    with pytest.raises(MismatchError, match="does not apply at line 2"):
        apply_patch(b"a\nY\nc\n", patch, "p")


@pytest.mark.parametrize(
    ("path", "include", "exclude", "expected"),
    [
        ("a/b/c.cu", ["**"], [], True),
        ("c.cu", ["**/*.cu"], [], True),
        ("a/b/c.cu", ["*.cu"], [], False),
        ("a/b/c.cu", ["a/*/c.cu"], [], True),
        ("a/b/c.cu", ["**"], ["a/**"], False),
        ("tests/t.py", ["**"], ["**/t?.py"], True),
    ],
)
def test_globs(path: str, include: list[str], exclude: list[str], expected: bool) -> None:
    assert select(path, include, exclude) is expected


@pytest.mark.parametrize(
    "drop",
    [
        "sm100_cutedsl_megamoe",
        "sm100_next_cutedsl_megamoe",
        "sm90_pull_cutedsl",
        "sm90_pull_nvfp4",
        "sm90_push_cuda",
    ],
)
def test_real_vendor_md_round_trips(drop: str) -> None:
    meta = load_meta(REPO / "vendor" / drop)
    again = parse_meta(render_meta(meta))
    assert again == meta
    assert meta.source.fields["sha256"] == (
        "a051a62e09a2738e8b0de47a1944fd2f0f3eff01b728b662141ea660cb09dd32"  # 0.7.4
    )


def test_front_matter_errors_name_the_key(tmp_path: Path) -> None:
    text = (REPO / "vendor" / "sm90_push_cuda" / "VENDOR.md").read_text()
    with pytest.raises(UsageError, match=r"\[source\]: missing key 'sha256'"):
        parse_meta(text.replace('sha256 = "', 'sha257 = "'))
    with pytest.raises(UsageError, match="must start with a `\\+\\+\\+` line"):
        parse_meta("# no front matter\n")
    with pytest.raises(UsageError, match="files is empty, so note must say"):
        parse_meta(text.replace("note = ", "not_note = "))


@pytest.mark.parametrize("bad", ["../evil.py", "a/../../evil.py", "/abs.py", "a//b.py"])
def test_unsafe_archive_paths_are_refused(bad: str) -> None:
    meta = load_meta(REPO / "vendor" / "sm90_push_cuda")
    with pytest.raises(SourceError, match="unsafe path"):
        ops._filtered({"ok.cu": (0o644, b""), bad: (0o644, b"x")}, meta)

"""Nothing planted in a build cache runs: the `cpu_fused` library cache and the sm90 push
module cache (`moe_ep.cache_trust`) against planted libraries, other owners, loose modes,
relative paths, a bad HOME, stale builds and concurrent builders.

Tests run as root here, so "another user" is simulated: files and directories chowned to
uid 65534 (nobody), group/world-writable modes, and one forked child that drops to nobody.
A planted library carries a constructor that writes a marker file: the marker's absence is
the proof that it never ran.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from push_fakes import push_sources

from moe_ep import env
from moe_ep.backends.portable import cpu_fused
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError

NOBODY = 65534
needs_cc = pytest.mark.skipif(cpu_fused._compiler() is None, reason="no C compiler on this machine")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="simulating other users needs root")

_PLANTED_C = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("planted code ran\\n", f); fclose(f); }
}
"""


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A fresh `cpu_fused` load state with MOE_EP_CPU_FUSED_CACHE at tmp/cache (returned)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MOE_EP_CPU_FUSED_CACHE", str(cache))
    monkeypatch.delenv("MOE_EP_CPU_FUSED", raising=False)
    monkeypatch.delenv("CC", raising=False)
    cpu_fused._load.cache_clear()
    yield cache
    cpu_fused._load.cache_clear()
    cpu_fused._warned.clear()


def _reload() -> tuple[bool, str]:
    cpu_fused._load.cache_clear()
    return cpu_fused.status()


def _planted_library(tmp_path: Path, marker: Path) -> bytes:
    """A shared library whose constructor writes `marker` (and that has none of our symbols)."""
    src = tmp_path / "planted.c"
    src.write_text(_PLANTED_C)
    out = tmp_path / "planted.so"
    cc = cpu_fused._compiler()
    assert cc is not None
    subprocess.run(
        [cc, "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(out)], check=True
    )
    return out.read_bytes()


def _libraries(cache: Path) -> list[Path]:
    libs = sorted(cache.rglob("*.so"))
    assert libs, f"no library under {cache}"
    return libs


def _replace(path: Path, blob: bytes) -> None:
    """Put `blob` at `path` as a new file (a new inode, as a planter would: rewriting the
    loaded library in place would let dlopen hand back the copy already mapped)."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(blob)
    os.replace(tmp, path)


def _plant(cache: Path, blob: bytes, *, record: bool) -> list[Path]:
    """Overwrite every library in `cache` with `blob`; with `record`, also rewrite a manifest
    beside it to match (what a writer who owns the files could do). Returns the libraries."""
    libs = _libraries(cache)
    for lib in libs:
        _replace(lib, blob)
        manifest = lib.parent / "manifest.json"
        if record and manifest.is_file():
            data = json.loads(manifest.read_text())
            data["sha256"][lib.name] = hashlib.sha256(blob).hexdigest()
            manifest.write_text(json.dumps(data))
    return libs


def _works() -> None:
    """The loaded library really is ours: a fused call runs and returns True."""
    import torch

    gu, h = torch.ones(2, 8, dtype=torch.bfloat16), torch.empty(2, 4, dtype=torch.bfloat16)
    assert cpu_fused.swiglu(gu, h, None, None)
    assert torch.allclose(h.float(), torch.full((2, 4), 0.7311), atol=1e-2)


# -- where the cache is -----------------------------------------------------------------


@needs_cc
def test_created_cache_directories_are_0700(fused: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = fused.parent / "a" / "b" / "c"
    monkeypatch.setenv("MOE_EP_CPU_FUSED_CACHE", str(cache))
    old = os.umask(0o022)  # what mkdir would otherwise leave: 0755
    try:
        assert _reload() == (True, "built and loaded")
    finally:
        os.umask(old)
    for d in (cache.parents[1], cache.parent, cache):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for lib in _libraries(cache):
        assert stat.S_IMODE(lib.parent.stat().st_mode) == 0o700
        assert not lib.stat().st_mode & 0o022


@pytest.mark.parametrize("var", ["MOE_EP_CPU_FUSED_CACHE", "MOE_EP_PUSH_CACHE"])
def test_relative_cache_variable_is_refused_naming_it(
    var: str, fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(fused.parent)
    with pytest.raises(
        MoeEpUsageError, match=f"{var} must be an absolute directory path, got 'rel"
    ):
        env.check_all({var: "rel/cache"})
    monkeypatch.setenv(var, "rel/cache")
    if var == "MOE_EP_CPU_FUSED_CACHE":
        with pytest.raises(MoeEpUsageError, match=f"{var} must be an absolute"):
            cpu_fused.library()
    else:
        push_build = pytest.importorskip("moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.build")
        with pytest.raises(MoeEpUsageError, match=f"{var} must be an absolute"):
            push_build.default_cache_dir()
    assert not (fused.parent / "rel").exists()


@needs_cc
def test_cache_path_that_is_a_file_is_refused(fused: Path) -> None:
    fused.write_text("not a directory")
    ok, why = _reload()
    assert not ok
    assert f"cache directory {fused} (MOE_EP_CPU_FUSED_CACHE='{fused}'): {fused} is not a" in why


@needs_cc
@pytest.mark.parametrize(
    ("home", "reason"),
    [
        (None, "MOE_EP_CPU_FUSED_CACHE is unset and HOME is unset or empty"),
        ("", "MOE_EP_CPU_FUSED_CACHE is unset and HOME is unset or empty"),
        ("relative/home", "HOME='relative/home' is not an absolute path"),
        ("<tmp>/no-such-home", "HOME='<tmp>/no-such-home' is not an existing directory"),
    ],
)
def test_bad_home_gives_a_clear_reason_and_creates_nothing(
    home: str | None, reason: str, fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: HOME unset fell back to the passwd entry, HOME="" built under "/.cache" (as
    # root), a missing HOME was created.
    monkeypatch.delenv("MOE_EP_CPU_FUSED_CACHE")
    monkeypatch.chdir(fused.parent)  # where a relative HOME would land
    tmp = str(fused.parent)
    if home is None:
        monkeypatch.delenv("HOME", raising=False)
    else:
        monkeypatch.setenv("HOME", home.replace("<tmp>", tmp))
    ok, why = _reload()
    assert not ok
    assert reason.replace("<tmp>", tmp) in why
    assert "set MOE_EP_CPU_FUSED_CACHE to an absolute directory only you can write" in why
    assert not (fused.parent / "no-such-home").exists()
    assert not (fused.parent / "relative").exists()
    monkeypatch.setenv("MOE_EP_CPU_FUSED", "1")
    with pytest.raises(MoeEpUnavailableError, match=r"MOE_EP_CPU_FUSED=1 but .*HOME"):
        cpu_fused.library()


def _as_nobody(fn: Callable[[], str]) -> str:
    """`fn()` in a forked child running as uid/gid 65534; its result or its exception."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        try:
            os.close(read)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                out = fn()
            except BaseException as exc:  # reported to the parent
                out = f"{type(exc).__name__}: {exc}"
            os.write(write, out.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


@needs_cc
@needs_root
def test_unwritable_home_names_home_and_the_variable(
    fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's tmp_path is root's alone
    try:
        os.chmod(base, 0o755)
        home = base / "home"
        home.mkdir(mode=0o755)  # root's: nobody cannot create .cache in it
        monkeypatch.delenv("MOE_EP_CPU_FUSED_CACHE")
        monkeypatch.setenv("HOME", str(home))
        cpu_fused._load.cache_clear()
        why = _as_nobody(lambda: repr(cpu_fused.status()))
    finally:
        shutil.rmtree(base)
    assert why.startswith("(False, ")
    assert f"cannot create cache directory {home}/.cache/moe-ep/cpu_fused" in why
    assert f"HOME='{home}'" in why and "set MOE_EP_CPU_FUSED_CACHE" in why
    assert "Permission denied" in why


# -- who can write it -------------------------------------------------------------------


def _loose_dir(kind: str, d: Path) -> str:
    """Make `d` writable by someone else; the reason the cache must give."""
    if kind == "world-writable":
        os.chmod(d, 0o777)
        return "is writable by group and others (mode 0777)"
    if kind == "group-writable":
        os.chmod(d, 0o770)
        return "is writable by group (mode 0770)"
    os.chown(d, NOBODY, NOBODY)
    return f"is owned by uid {NOBODY}, not by this user (uid 0)"


@needs_cc
@needs_root
@pytest.mark.parametrize("kind", ["world-writable", "group-writable", "owned by nobody"])
def test_cache_dir_another_user_can_write_is_refused(
    kind: str, fused: Path, tmp_path: Path
) -> None:
    assert _reload()[0]
    marker = tmp_path / "PLANTED_RAN"
    _plant(fused, _planted_library(tmp_path, marker), record=True)
    reason = _loose_dir(kind, fused)
    ok, why = _reload()
    assert not marker.exists(), "a library planted in a cache others can write was loaded"
    assert not ok
    assert f"cache directory {fused} (MOE_EP_CPU_FUSED_CACHE='{fused}') is not private" in why
    assert f"{fused} {reason}" in why


@needs_cc
@needs_root
@pytest.mark.parametrize(("mode", "refused"), [(0o777, True), (0o1777, False)])
def test_directory_above_the_cache_others_can_write(
    mode: int, refused: bool, fused: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Others who can write a non-sticky parent can rename the cache and put theirs there;
    # a sticky one (/tmp) lets them create entries but not replace ours.
    shared = fused.parent / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    monkeypatch.setenv("MOE_EP_CPU_FUSED_CACHE", str(shared / "cache"))
    ok, why = _reload()
    if refused:
        assert not ok
        assert f"{shared} is writable by group and others and not sticky (mode 0777)" in why
    else:
        assert (ok, why) == (True, "built and loaded")


@needs_cc
@needs_root
@pytest.mark.parametrize(
    "plant",
    ["library owned by nobody", "manifest owned by nobody", "group-writable", "world-writable",
     "digest differs"],
)  # fmt: skip
def test_library_planted_at_the_digest_path_is_never_loaded(
    plant: str, fused: Path, tmp_path: Path
) -> None:
    assert _reload()[0]
    marker = tmp_path / "PLANTED_RAN"
    libs = _plant(fused, _planted_library(tmp_path, marker), record=plant != "digest differs")
    for lib in libs:
        if plant == "library owned by nobody":
            os.chown(lib, NOBODY, NOBODY)
        elif plant == "manifest owned by nobody" and (lib.parent / "manifest.json").exists():
            os.chown(lib.parent / "manifest.json", NOBODY, NOBODY)
        elif plant == "group-writable":
            os.chmod(lib, 0o775)
        elif plant == "world-writable":
            os.chmod(lib, 0o777)
    assert _reload() == (True, "built and loaded")
    assert not marker.exists(), "the planted library was loaded"
    _works()
    for lib in _libraries(fused):  # replaced by a fresh build of ours
        st = lib.stat()
        assert st.st_uid == os.geteuid() and not st.st_mode & 0o022
        assert b"moe_ep_swiglu_bf16" in lib.read_bytes()


# -- stale builds -----------------------------------------------------------------------


@needs_cc
def test_cached_library_missing_symbols_is_rebuilt(fused: Path, tmp_path: Path) -> None:
    # An older build recorded as ours (manifest matches): loads, but lacks what we bind.
    # Before: AttributeError out of status().
    assert _reload()[0]
    stale = _planted_library(tmp_path, tmp_path / "STALE_LOADED")
    _plant(fused, stale, record=True)
    assert _reload() == (True, "built and loaded")
    _works()
    assert all(lib.read_bytes() != stale for lib in _libraries(fused))


@needs_cc
def test_truncated_cached_library_is_rebuilt(fused: Path) -> None:
    assert _reload()[0]
    whole = {lib: lib.read_bytes() for lib in _libraries(fused)}
    for lib, blob in whole.items():
        _replace(lib, blob[: len(blob) // 2])  # may still load, until a missing page is hit
    assert _reload() == (True, "built and loaded")
    _works()
    assert {lib: lib.stat().st_size for lib in _libraries(fused)} == {
        lib: len(blob) for lib, blob in whole.items()
    }, "the truncated library was kept"


@needs_cc
def test_fresh_build_missing_symbols_is_refused_clearly(
    fused: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A compiler that "succeeds" but builds something else: never an AttributeError.
    real = cpu_fused._compiler()
    (tmp_path / "empty.c").write_text("int moe_ep_unrelated(void) { return 0; }\n")
    fake = tmp_path / "fake-cc"
    fake.write_text(
        "#!/bin/sh\n"
        'for a; do [ "$prev" = -o ] && out=$a; prev=$a; done\n'
        f'[ -n "$out" ] || exec {real} "$@"\n'
        f'exec {real} -shared -fPIC {tmp_path / "empty.c"} -o "$out"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    ok, why = _reload()
    assert not ok
    assert "the fresh build is unusable" in why and "lacks moe_ep_swiglu_bf16" in why
    monkeypatch.setenv("MOE_EP_CPU_FUSED", "1")
    with pytest.raises(MoeEpUnavailableError, match="lacks moe_ep_swiglu_bf16"):
        cpu_fused.library()
    assert not list(fused.iterdir()), "an unusable build was published"


# -- concurrent builders ----------------------------------------------------------------


def _barrier_script(tmp_path: Path, name: str, body: str) -> Path:
    """An executable Python script: `wait_for_peer` (below), then `body` (not indented)."""
    script = tmp_path / name
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(_WAIT_FOR_PEER) + body)
    script.chmod(0o755)
    return script


_WAIT_FOR_PEER = """
    import os, sys, time
    from pathlib import Path

    def wait_for_peer(barrier: Path, me: str) -> None:
        (barrier / me).touch()
        deadline = time.monotonic() + 120
        while len(list(barrier.iterdir())) < 2:
            if time.monotonic() > deadline:
                sys.exit("fake compiler: the other builder never arrived")
            time.sleep(0.02)
"""


@needs_cc
def test_two_processes_building_at_once_both_load_one_entry(fused: Path, tmp_path: Path) -> None:
    """Both builders compile at the same moment (a compiler wrapper waits for the other);
    each loads a whole library, the cache ends with one verified entry and no leftovers."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    cc = cpu_fused._compiler()
    wrapper = _barrier_script(
        tmp_path,
        "cc-wrapper",
        f'if "-o" in sys.argv:\n'
        f'    wait_for_peer(Path({str(barrier)!r}), os.environ["BUILDER"])\n'
        f"os.execv({cc!r}, [{cc!r}, *sys.argv[1:]])\n",
    )
    code = "from moe_ep.backends.portable import cpu_fused; print(cpu_fused.status())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={
                **os.environ,
                "CC": str(wrapper),
                "BUILDER": who,
                "MOE_EP_CPU_FUSED_CACHE": str(fused),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for who in ("a", "b")
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for (out, err), p in zip(outs, procs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "(True, 'built and loaded')", err
    assert len(list(barrier.iterdir())) == 2  # they did build at the same time
    entries = list(fused.iterdir())
    assert len(entries) == 1, entries
    from moe_ep import cache_trust

    assert cache_trust.entry_problem(entries[0]) is None


# -- the sm90 push module cache ---------------------------------------------------------

_FAKE_NVCC = """
    args = sys.argv[1:]
    if args == ["--version"]:  # the cache key's toolchain version
        sys.exit(print("fake nvcc: Cuda compilation tools, release 0.0"))
    out = Path(args[args.index("-o") + 1])
    with open(os.environ["FAKE_NVCC_LOG"], "a") as log:
        log.write(out.name + "\\n")
    if "-c" in args and os.environ.get("FAKE_NVCC_BARRIER"):
        gen = Path(next(a[2:] for a in args if a.startswith("-I")))
        def snapshot():
            return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in gen.iterdir()}
        before = snapshot()
        barrier = Path(os.environ["FAKE_NVCC_BARRIER"])
        me = os.environ["FAKE_NVCC_ID"]
        if not (barrier / me).exists():
            wait_for_peer(barrier, me)
            time.sleep(0.2)
        if snapshot() != before:
            sys.exit(f"fake nvcc: {gen} changed under this compile")
    srcs = [Path(a).name for a in args if a.endswith((".cu", ".o"))]
    out.write_text("module built from " + " ".join(srcs))
"""


@pytest.fixture
def fake_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    log = tmp_path / "nvcc.log"
    log.touch()
    monkeypatch.setenv("FAKE_NVCC_LOG", str(log))
    return _barrier_script(tmp_path, "fake-nvcc", textwrap.dedent(_FAKE_NVCC))


def _calls(tmp_path: Path) -> int:
    return len((tmp_path / "nvcc.log").read_text().splitlines())


@needs_root
@pytest.mark.parametrize(
    "plant",
    ["gemm module replaced", "generated header replaced", "extra generated header",
     "a2a module owned by nobody", "a2a module world-writable"],
)  # fmt: skip
def test_push_cache_entry_planted_file_is_rebuilt(
    plant: str, tmp_path: Path, fake_nvcc: Path
) -> None:
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    s = push_sources(tmp_path)
    cache = tmp_path / "push"
    built = push_build.build_modules(s, cache, nvcc=str(fake_nvcc))  # type: ignore[arg-type]
    genuine = built.gemm.read_text(), built.a2a.read_text()
    assert genuine[0].startswith("module built from") and genuine[1].startswith("module")
    n = _calls(tmp_path)
    assert push_build.build_modules(s, cache, nvcc=str(fake_nvcc)) == built  # type: ignore[arg-type]
    assert _calls(tmp_path) == n, "a good entry was rebuilt"
    gen = built.jit_include_dirs[0]
    if plant == "gemm module replaced":
        built.gemm.write_text("planted")
    elif plant == "generated header replaced":  # the run-time JIT compiles include it
        (gen / "fp8_moe_jit.cuh").write_text("planted")
    elif plant == "extra generated header":
        (gen / "cuda_runtime.h").write_text("planted")
    elif plant == "a2a module owned by nobody":
        os.chown(built.a2a, NOBODY, NOBODY)
    else:
        os.chmod(built.a2a, 0o777)
    again = push_build.build_modules(s, cache, nvcc=str(fake_nvcc))  # type: ignore[arg-type]
    assert _calls(tmp_path) > n, "the planted entry was used as it was"
    assert (again.gemm.read_text(), again.a2a.read_text()) == genuine
    assert not (gen / "cuda_runtime.h").exists()
    assert (gen / "fp8_moe_jit.cuh").read_text() == "// fp8_moe_jit.cuh\n"
    assert again.a2a.stat().st_uid == 0 and not again.a2a.stat().st_mode & 0o022
    assert [p.name for p in cache.iterdir()] == [again.gemm.parent.name]  # nothing left aside


def test_push_cache_directories_are_0700(tmp_path: Path, fake_nvcc: Path) -> None:
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    cache = tmp_path / "c" / "push"
    old = os.umask(0o022)
    try:
        built = push_build.build_modules(push_sources(tmp_path), cache, nvcc=str(fake_nvcc))  # type: ignore[arg-type]
    finally:
        os.umask(old)
    for d in (cache.parent, cache, built.gemm.parent, built.jit_include_dirs[0]):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in (built.gemm, built.a2a, *built.jit_include_dirs[0].iterdir()):
        assert not f.stat().st_mode & 0o022, f


@needs_root
@pytest.mark.parametrize("kind", ["world-writable", "group-writable", "owned by nobody"])
def test_push_cache_dir_another_user_can_write_is_refused(
    kind: str, tmp_path: Path, fake_nvcc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build

    s = push_sources(tmp_path)
    cache = tmp_path / "push"
    cache.mkdir()
    reason = _loose_dir(kind, cache)
    with pytest.raises(MoeEpUnavailableError, match="is not private") as info:
        push_build.build_modules(s, cache, nvcc=str(fake_nvcc))  # type: ignore[arg-type]
    assert f"{cache} {reason}" in str(info.value)
    assert _calls(tmp_path) == 0
    monkeypatch.setenv("MOE_EP_PUSH_CACHE", str(cache))
    with pytest.raises(MoeEpUnavailableError, match=f"MOE_EP_PUSH_CACHE='{cache}'"):
        push_build.default_cache_dir()
    monkeypatch.delenv("MOE_EP_PUSH_CACHE")
    monkeypatch.delenv("HOME")
    with pytest.raises(MoeEpUnavailableError, match="MOE_EP_PUSH_CACHE is unset and HOME is"):
        push_build.default_cache_dir()


def test_push_builders_at_once_never_touch_each_others_files(
    tmp_path: Path, fake_nvcc: Path
) -> None:
    """Builder A holds its first GEMM compile open until builder B reaches its own; A's
    fake nvcc fails if any file in the generated dir it compiles from changed meanwhile
    (before: B rewrote A's headers in the shared entry while A compiled from them)."""
    s = push_sources(tmp_path)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build
        s = push_build.PushSources(**{{k: (Path(v) if isinstance(v, str) else v)
                                      for k, v in {_fields(s)!r}.items()}})
        print(push_build.build_modules(s, Path({str(tmp_path / "cache")!r}),
                                       nvcc={str(fake_nvcc)!r}).gemm)
        """
    )

    def start(who: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "FAKE_NVCC_BARRIER": str(barrier), "FAKE_NVCC_ID": who},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    a = start("a")
    deadline = time.monotonic() + 60
    while not (barrier / "a").exists():
        assert a.poll() is None, a.communicate()
        assert time.monotonic() < deadline, "builder a never reached its GEMM compile"
        time.sleep(0.02)
    b = start("b")
    results = [(*p.communicate(timeout=120), p.returncode) for p in (a, b)]
    for _, err, rc in results:
        assert rc == 0, err[-2000:]
    assert results[0][0] == results[1][0], "the builders ended on different entries"
    from moe_ep import cache_trust

    gemm = Path(results[0][0].strip())
    assert cache_trust.entry_problem(gemm.parent) is None
    assert gemm.read_text().startswith("module built from")
    assert len(list((tmp_path / "cache").iterdir())) == 1


def _fields(s: object) -> dict[str, object]:
    return {
        k: (str(v) if isinstance(v, Path) else tuple(str(x) for x in v)) for k, v in vars(s).items()
    }

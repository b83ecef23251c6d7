"""The sm90 push module cache's entry name (`build.cache_entry_name`): the sources and flags
(`source_digest`) and the toolchain (nvcc's `--version`, torch, torch's CUDA, apache-tvm-ffi,
the arch). CPU only: fake sources and fake nvcc scripts, versions monkeypatched."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from push_fakes import push_sources

from moe_ep.errors import MoeEpUnavailableError

push_build: Any = pytest.importorskip("moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.build")


@pytest.fixture(autouse=True)
def _fresh_versions() -> Any:
    push_build.nvcc_version.cache_clear()  # read once per path and process: not across tests
    yield
    push_build.nvcc_version.cache_clear()


def _nvcc(tmp_path: Path, name: str, release: str = "12.8", body: str = "") -> str:
    """A fake nvcc: `--version` prints `release` (logged), `-o X` writes X."""
    script = tmp_path / name
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        "from pathlib import Path\n"
        "args = sys.argv[1:]\n"
        f"{body}"
        "if args == ['--version']:\n"
        f"    with open({str(tmp_path / (name + '.log'))!r}, 'a') as log:\n"
        "        log.write('version\\n')\n"
        f"    sys.exit(print('Cuda compilation tools, release {release}'))\n"
        "out = Path(args[args.index('-o') + 1])\n"
        "out.write_text('built ' + ' '.join(Path(a).name for a in args if a.endswith('.cu')))\n"
    )
    script.chmod(0o755)
    return str(script)


def test_the_same_inputs_give_the_same_name_and_nvcc_is_asked_once(tmp_path: Path) -> None:
    s = push_sources(tmp_path)
    nvcc = _nvcc(tmp_path, "nvcc")
    name = push_build.cache_entry_name(s, nvcc)
    assert len(name) == 20 and int(name, 16) >= 0
    assert push_build.cache_entry_name(s, nvcc) == name
    assert (tmp_path / "nvcc.log").read_text() == "version\n"  # read once in this process
    push_build.nvcc_version.cache_clear()
    assert push_build.cache_entry_name(s, nvcc) == name  # read again: the same
    # another path answering the same version: the path is not in the key
    assert push_build.cache_entry_name(s, _nvcc(tmp_path, "nvcc-copy")) == name


def _real_version(name: str) -> str:
    return importlib.metadata.distribution(name).version


def _planted_tvm(version: str | None) -> Callable[[str], str]:
    def version_of(name: str) -> str:
        if name != "apache-tvm-ffi":
            return _real_version(name)
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    return version_of


CHANGES = ["nvcc", "torch", "torch.version.cuda", "tvm-ffi", "tvm-ffi absent", "arch", "source"]


@pytest.mark.parametrize("change", CHANGES)
def test_changing_one_input_gives_another_name(
    change: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = push_sources(tmp_path)
    nvcc = first_nvcc = _nvcc(tmp_path, "nvcc")
    base = _planted_tvm("1.0.0")  # installed or not here, the absent case then differs
    monkeypatch.setattr(importlib.metadata, "version", base)
    before = push_build.cache_entry_name(s, nvcc)
    arch = push_build.BUILD_ARCH
    if change == "nvcc":
        nvcc = _nvcc(tmp_path, "nvcc-13", release="13.0")
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "0.0.1+planted")
    elif change == "torch.version.cuda":
        monkeypatch.setattr(torch.version, "cuda", "99.9")
    elif change.startswith("tvm-ffi"):
        planted = None if change.endswith("absent") else "1.0.1"
        monkeypatch.setattr(importlib.metadata, "version", _planted_tvm(planted))
    elif change == "arch":
        arch = "sm_100a"
    else:
        (s.deps_src / "csrc" / "common.h").write_text("// deps, changed\n")
    assert push_build.cache_entry_name(s, nvcc, arch) != before
    monkeypatch.undo()
    monkeypatch.setattr(importlib.metadata, "version", base)
    if change != "source":  # that one change was the difference
        assert push_build.cache_entry_name(s, first_nvcc) == before


def test_the_recorded_versions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version", _planted_tvm(None))
    got = push_build.toolchain_versions(_nvcc(tmp_path, "nvcc", release="12.9"))
    assert got == {
        "nvcc": "Cuda compilation tools, release 12.9",
        "torch": torch.__version__,
        "torch.version.cuda": str(torch.version.cuda),
        "apache-tvm-ffi": "absent",
        "arch": "sm_90a",
    }


def test_nvcc_missing_failing_or_hanging_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = push_sources(tmp_path)
    missing = str(tmp_path / "no-such-nvcc")
    with pytest.raises(MoeEpUnavailableError, match=r"nvcc '.*no-such-nvcc' was not found"):
        push_build.build_modules(s, tmp_path / "cache", nvcc=missing)
    not_executable = tmp_path / "nvcc-plain-file"
    not_executable.write_text("")
    with pytest.raises(MoeEpUnavailableError, match=r"nvcc-plain-file' cannot be run: .*denied"):
        push_build.cache_entry_name(s, str(not_executable))
    failing = _nvcc(tmp_path, "nvcc-bad", body="sys.exit(print('boom', file=sys.stderr) or 3)\n")
    with pytest.raises(MoeEpUnavailableError, match=r"--version exited 3 with no version: boom"):
        push_build.cache_entry_name(s, failing)
    monkeypatch.setattr(push_build, "NVCC_VERSION_TIMEOUT_S", 0.5)
    hanging = _nvcc(tmp_path, "nvcc-slow", body="time.sleep(30)\n")
    with pytest.raises(MoeEpUnavailableError, match=r"did not answer within 0.5 s"):
        push_build.cache_entry_name(s, hanging)


def test_build_modules_files_entries_by_that_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another torch version builds another entry; the generated header keeps the sources-only
    digest the run-time FC1 cache is keyed by."""
    s = push_sources(tmp_path)
    nvcc = _nvcc(tmp_path, "nvcc")
    cache = tmp_path / "cache"
    first = push_build.build_modules(s, cache, nvcc=nvcc)
    assert first.gemm.parent.name == push_build.cache_entry_name(s, nvcc)
    assert push_build.build_modules(s, cache, nvcc=nvcc) == first  # reused
    monkeypatch.setattr(torch, "__version__", "0.0.1+planted")
    second = push_build.build_modules(s, cache, nvcc=nvcc)
    assert second.gemm.parent != first.gemm.parent
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [first.gemm.parent.name, second.gemm.parent.name]
    )
    digest = push_build.source_digest(s, push_build.module_flags())[:20]
    for built in (first, second):
        header = (built.jit_include_dirs[0] / "fp8_moe_build_config.h").read_text()
        assert f'SOURCE_DIGEST "{digest}"' in header

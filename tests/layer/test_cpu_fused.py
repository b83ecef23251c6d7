"""The fused CPU epilogues (`moe_ep.backends.portable.cpu_fused`) against the eager code.

The combine must equal the eager combine bit for bit; SwiGLU may differ from eager (ATen's
SLEEF exp vs ours) only in rare last bits, and must stay within one bf16 ulp of the exactly
rounded fp64 formula wherever eager does.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moe_ep.backends.portable import comm, cpu_fused, experts
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError

needs_cc = pytest.mark.skipif(cpu_fused._compiler() is None, reason="no C compiler on this machine")


@pytest.fixture
def fresh_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    """Rebuild state for one test (own cache dir, env), restored afterwards."""
    monkeypatch.setenv("MOE_EP_CPU_FUSED_CACHE", str(tmp_path / "cache"))
    cpu_fused._load.cache_clear()
    cpu_fused._warned.clear()
    yield monkeypatch
    cpu_fused._load.cache_clear()
    cpu_fused._warned.clear()


def _eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_fused, "library", lambda: None)


def _special_gu(rows: int, inter: int, ld: int, gen: torch.Generator) -> torch.Tensor:
    """`[rows, 2 * inter]` bf16 view with row stride `ld`: wide normals plus edge values."""
    buf = (torch.randn(rows, ld, generator=gen) * 6).bfloat16()
    gu = buf[:, : 2 * inter]
    edges = [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 100.0, -100.0, -88.5,
             88.8, -87.2, 1e-30, -1e-30, 3e38, -3e38]  # fmt: skip
    for j, v in enumerate(edges):
        gu[j % rows, j] = v  # g
        gu[(j + 1) % rows, inter + j] = 2.5  # its u: finite, so the g edge shows
        gu[(j + 2) % rows, inter + j + len(edges)] = v  # u edges
    return gu


@pytest.mark.parametrize(
    ("gu_shape", "h_shape"), [((4, 10), (4, 4)), ((4, 6), (4, 4)), ((5, 8), (4, 4)), ((8,), (4,))]
)
def test_swiglu_refuses_shapes_that_do_not_pair(
    gu_shape: tuple[int, ...], h_shape: tuple[int, ...]
) -> None:
    """A gu wider than 2 * I used to run, reading u from the wrong columns (wrong values, no
    error); a narrower one or more rows read past the tensor."""
    gu, h = torch.ones(gu_shape, dtype=torch.bfloat16), torch.empty(h_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"swiglu gu must be \[rows, 2 \* I\] for h"):
        cpu_fused.swiglu(gu, h, None, None)


@needs_cc
@pytest.mark.parametrize(("alpha", "clamp"), [(None, None), (0.75, None), (None, 7.0), (1.5, 7.0)])
def test_swiglu_fused_within_one_ulp_of_eager(
    monkeypatch: pytest.MonkeyPatch, alpha: float | None, clamp: float | None
) -> None:
    gen = torch.Generator().manual_seed(3)
    rows, inter = 67, 300  # odd sizes: vector bodies and scalar tails both run
    gu = _special_gu(rows, inter, 2 * inter + 24, gen)
    h_pad = torch.empty(rows, inter + 8, dtype=torch.bfloat16)
    fused = h_pad[:, :inter]  # strided output rows
    assert cpu_fused.swiglu(gu, fused, alpha, clamp)
    eager = torch.empty(rows, inter, dtype=torch.bfloat16)
    with monkeypatch.context() as m:
        _eager(m)
        experts._swiglu(gu, eager, alpha, clamp, None, comm.Workspace())
    nan = torch.isnan(eager)
    assert torch.equal(torch.isnan(fused), nan)
    a, b = fused[~nan].view(torch.int16).int(), eager[~nan].view(torch.int16).int()
    diff = (a - b).abs()
    assert int(diff.max()) <= 1, "fused SwiGLU more than one bf16 ulp from eager"
    assert int((diff != 0).sum()) <= max(1, a.numel() // 1000)
    # and against the fp64 formula (exactly rounded), where finite
    g, u = gu[:, :inter].double(), gu[:, inter:].double()
    if alpha is not None:
        g, u = g * alpha, u * alpha
    if clamp is not None:
        g, u = g.clamp(max=clamp), u.clamp(-clamp, clamp)
    ref = (g * torch.sigmoid(g) * u).bfloat16()
    ok = torch.isfinite(ref) & torch.isfinite(fused)
    step = (ref[ok].view(torch.int16).int() - fused[ok].view(torch.int16).int()).abs()
    assert int(step.max()) <= 1


@needs_cc
@pytest.mark.parametrize(("alpha", "clamp"), [(None, None), (0.75, 7.0)])
def test_swiglu_vector_body_equals_the_scalar_loop(
    alpha: float | None, clamp: float | None
) -> None:
    """Rows of 300 run 16-wide vector bodies where the CPU has them; rows of one element run
    the scalar loop only: every element must come out with the same bits either way."""
    gen = torch.Generator().manual_seed(5)
    rows, inter = 40, 300
    gu = _special_gu(rows, inter, 2 * inter, gen).contiguous()
    tiny = (torch.randn(inter, generator=gen) * 1e-20).bfloat16()
    gu[3, :inter], gu[3, inter:] = tiny, tiny  # products far below fp32's smallest normal
    gu[4, :inter] = (torch.randn(inter, generator=gen) * 1e-19).bfloat16()
    gu[4, inter:] = (torch.randn(inter, generator=gen) * 2e-19).bfloat16()  # near it
    h = torch.empty(rows, inter, dtype=torch.bfloat16)
    assert cpu_fused.swiglu(gu, h, alpha, clamp)
    one = torch.stack([gu[:, :inter].reshape(-1), gu[:, inter:].reshape(-1)], 1).contiguous()
    h_one = torch.empty(rows * inter, 1, dtype=torch.bfloat16)
    assert cpu_fused.swiglu(one, h_one, alpha, clamp)
    assert torch.equal(h.view(torch.int16).reshape(-1), h_one.view(torch.int16).reshape(-1))
    sub = h[3].float().abs()
    assert bool(((sub > 0) & (sub < torch.finfo(torch.float32).tiny)).any())  # subnormals ran


@needs_cc
@pytest.mark.parametrize(("alpha", "clamp"), [(None, None), (1.702, 7.0)])
def test_swiglu_every_bf16_gate_value_vector_equals_scalar(
    alpha: float | None, clamp: float | None
) -> None:
    """All 65536 bf16 gate values (the vector body may look silu up by the bits, or compute
    exp on 8 or 16 lanes), with an up value that keeps most products normal and one that
    makes many subnormal; with alpha and clamp, one beyond the clamp too."""
    g = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for up in (2.5, 3e-38, -9.0):
        narrow = torch.cat([g.view(2**15, 2), torch.full((2**15, 2), up).bfloat16()], 1)
        h = torch.empty(2**15, 2, dtype=torch.bfloat16)  # rows of two: scalar loop only
        assert cpu_fused.swiglu(narrow, h, alpha, clamp)
        wide = torch.cat([g.view(2**11, 32), torch.full((2**11, 32), up).bfloat16()], 1)
        h_wide = torch.empty(2**11, 32, dtype=torch.bfloat16)  # two full vectors per row
        assert cpu_fused.swiglu(wide, h_wide, alpha, clamp)
        assert torch.equal(h.view(torch.int16).reshape(-1), h_wide.view(torch.int16).reshape(-1))


@needs_cc
@pytest.mark.parametrize(("n", "k", "hidden"), [(37, 1, 700), (37, 2, 512), (64, 8, 1030)])
def test_combine_fused_equals_eager_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, n: int, k: int, hidden: int
) -> None:
    gen = torch.Generator().manual_seed(n + k)
    y = (torch.randn(n * k + 5, hidden, generator=gen) * 50).bfloat16()
    y[0], y[1] = float("nan"), float("inf")  # rows no valid slot reads: must not leak
    pos = torch.randint(2, n * k + 5, (n, k), generator=gen)
    w = torch.rand(n, k, generator=gen)
    pos[torch.rand(n, k, generator=gen) < 0.2] = -1  # padded slots, as combine passes them
    pos[3] = -1  # a token with no valid slot
    fused = torch.empty(n, hidden, dtype=torch.bfloat16)
    assert cpu_fused.combine(y, pos, w, fused)
    eager = torch.empty_like(fused)
    comm._combine_eager(y, pos, w.unsqueeze(2), eager, comm.Workspace())
    assert torch.equal(fused.view(torch.int16), eager.view(torch.int16))
    # the definition, slot by slot: +0 for a padded slot, else one fp32 product; fp32 sums
    acc = torch.zeros(n, hidden)
    for j in range(k):
        term = torch.where(
            (pos[:, j] >= 0)[:, None], y[pos[:, j].clamp(min=0)].float() * w[:, j, None], 0.0
        )
        acc = term if j == 0 else acc + term
    assert torch.equal(fused.view(torch.int16), acc.bfloat16().view(torch.int16))
    assert bool(torch.isfinite(fused).all()) and not bool(fused[3].view(torch.int16).any())


@needs_cc
def test_thread_split_gives_the_same_bits() -> None:
    gen = torch.Generator().manual_seed(9)
    gu = _special_gu(90, 256, 512, gen)
    y = torch.randn(400, 384, generator=gen).bfloat16()
    pos = torch.randint(0, 400, (100, 4), generator=gen)
    w = torch.rand(100, 4, generator=gen)
    outs = []
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            h = torch.empty(90, 256, dtype=torch.bfloat16)
            o = torch.empty(100, 384, dtype=torch.bfloat16)
            assert cpu_fused.swiglu(gu, h, None, None) and cpu_fused.combine(y, pos, w, o)
            outs.append((h.view(torch.int16), o.view(torch.int16)))
    finally:
        torch.set_num_threads(threads)
    for h, o in outs[1:]:
        assert torch.equal(h, outs[0][0]) and torch.equal(o, outs[0][1])


def test_not_applicable_inputs_are_left_to_eager() -> None:
    gu = torch.randn(4, 8)  # fp32: the eager path handles it
    h = torch.empty(4, 4)
    assert not cpu_fused.swiglu(gu, h, None, None)
    y = torch.randn(4, 6).bfloat16()
    out = torch.empty(3, 6, dtype=torch.bfloat16)
    pos, w = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    assert not cpu_fused.combine(y.t().contiguous().t(), pos, w, out)  # column-major rows


@needs_cc
def test_builds_once_into_the_cache_dir(fresh_load: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert cpu_fused.status() == (True, "built and loaded")
    built = list((tmp_path / "cache").glob("cpu_fused-*/cpu_fused.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    cpu_fused._load.cache_clear()
    assert cpu_fused.status()[0]
    assert [p.stat().st_mtime_ns for p in (tmp_path / "cache").glob("*/*.so")] == [stamp]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [built[0].parent.name]


def test_env_zero_keeps_eager(fresh_load: pytest.MonkeyPatch) -> None:
    fresh_load.setenv("MOE_EP_CPU_FUSED", "0")
    assert cpu_fused.status() == (False, "disabled by MOE_EP_CPU_FUSED=0")
    assert not cpu_fused.swiglu(
        torch.zeros(2, 8).bfloat16(), torch.empty(2, 4).bfloat16(), None, None
    )


def test_env_bad_value_names_the_variable(fresh_load: pytest.MonkeyPatch) -> None:
    fresh_load.setenv("MOE_EP_CPU_FUSED", "yes")
    with pytest.raises(MoeEpUsageError, match="MOE_EP_CPU_FUSED must be auto, 0 or 1, got 'yes'"):
        cpu_fused.library()


@pytest.mark.skipif(shutil.which("false") is None, reason="needs `false`")
def test_failing_compiler_warns_once_in_auto_and_raises_when_required(
    fresh_load: pytest.MonkeyPatch,
) -> None:
    fresh_load.setenv("CC", str(shutil.which("false")))
    with pytest.warns(UserWarning, match=r"eager CPU epilogues .*building cpu_fused.c failed"):
        assert cpu_fused.library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_fused.library() is None  # warned once only
    fresh_load.setenv("MOE_EP_CPU_FUSED", "1")
    with pytest.raises(MoeEpUnavailableError, match=r"MOE_EP_CPU_FUSED=1 but .*failed"):
        cpu_fused.library()


@needs_cc
def test_run_single_threaded_gives_each_task_one_thread_and_restores_the_caller() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert cpu_fused.parallel_workers(torch.device("cpu")) == 2
        assert cpu_fused.parallel_workers(torch.device("meta")) == 1
        seen: list[tuple[str, int]] = []

        def task(name: str) -> None:
            torch.mm(torch.randn(64, 64), torch.randn(64, 64))  # a parallel torch op first
            seen.append((name, torch.get_num_threads()))

        cpu_fused.run_single_threaded([lambda: task("caller"), lambda: task("worker")])
        assert sorted(seen) == [("caller", 1), ("worker", 1)]
        assert torch.get_num_threads() == 2  # the caller's own setting is back
        with pytest.raises(ValueError, match="boom"):
            cpu_fused.run_single_threaded(
                [lambda: None, lambda: (_ for _ in ()).throw(ValueError("boom"))]
            )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@needs_cc
@pytest.mark.skipif(
    not {"avx2", "fma"} <= set(cpu_fused._cpu_features().split()),
    reason="the CPU lacks AVX2 or FMA",
)
def test_the_library_has_the_avx2_bodies_where_the_cpu_runs_them() -> None:
    """A source that does not build with the native arch flags falls back to a portable
    build, silently slower and with the AVX2 tests skipped: this one says so."""
    assert cpu_fused.library() is not None
    assert cpu_fused.vector_bodies() & 1, "the native-arch build failed: see cpu_fused.status()"


@pytest.mark.skipif(
    not {"amx_bf16", "amx_tile", "avx512vbmi"} <= set(cpu_fused._cpu_features().split()),
    reason="this CPU has no AMX-BF16 (or no AVX512-VBMI, which the AMX bodies' decode uses)",
)
def test_the_library_has_the_amx_body_where_the_cpu_runs_it() -> None:
    """Where the CPU has AMX-BF16 (and AVX512-VBMI, as every AMX CPU so far) the native
    build has the AMX body and Linux grants it the tile state (arch_prctl): otherwise the
    default would quietly sum in another order."""
    assert cpu_fused.vector_bodies() & 16, (
        "no AMX body: the native-arch build failed or arch_prctl(ARCH_REQ_XCOMP_PERM) was "
        f"refused (moe_ep_vector_bodies() = {cpu_fused.vector_bodies():#x})"
    )


def _knows_amx(cc: str) -> bool:
    """Whether `cc` compiles AMX code (GCC 11+, clang 12+): cpu_fused.c has the AMX body then."""
    proc = subprocess.run([cc, "-mamx-bf16", "-E", "-x", "c", "/dev/null"], capture_output=True,
                          check=False)  # fmt: skip
    return proc.returncode == 0


@needs_cc
@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64"), reason="the x86 vector bodies: x86 only"
)
@pytest.mark.parametrize(
    "arch",
    [[], ["-march=x86-64-v3"], ["-march=x86-64-v4"], ["-march=x86-64-v4", "-mavx512bf16"]],
    ids=["portable", "avx2", "avx512f", "avx512bf16"],
)
def test_every_vector_body_compiles(arch: list[str], tmp_path: Path) -> None:
    """The source builds for each x86 level, whatever this CPU runs: a body that does not
    compile would make a native build fall back to the portable one on such CPUs only."""
    cc = cpu_fused._compiler()
    assert cc is not None
    proc = subprocess.run(
        [cc, "-O1", "-c", "-std=c11", "-Werror=implicit-function-declaration",
         *arch, str(cpu_fused.SOURCE), "-o", str(tmp_path / "cpu_fused.o")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    dis = shutil.which("objdump")
    if "-mavx512bf16" in arch and dis:  # the epilogues' AVX-512 block is really in it
        out = subprocess.run([dis, "-d", str(tmp_path / "cpu_fused.o")], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        assert "vcvtneps2bf16" in out and "vscalefps" in out
    if arch and dis and _knows_amx(cc):  # the AMX body (by target attribute) is in it too
        out = subprocess.run([dis, "-d", str(tmp_path / "cpu_fused.o")], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        assert "tdpbf16ps" in out and "ldtilecfg" in out

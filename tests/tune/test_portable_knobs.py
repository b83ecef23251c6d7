"""The portable kernels' speed fields: `cpu_threads` (a tuning knob: the same bits at every
thread count, for every portable format, on both experts paths) and `expert_gemm_rows` (the
experts path crossover: honoured, and an explicit field, not a knob, because the two paths
give different bits); their validation; the grid `moe-ep tune` sweeps."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable import comm, experts
from moe_ep.backends.portable import kernel as portable_kernel
from moe_ep.backends.portable.configs import Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig
from moe_ep.device import usable_cpus
from moe_ep.errors import MoeEpUsageError
from moe_ep.registry import get_kernel
from moe_ep.spawn import free_port
from moe_ep.tune.tuners import valid_grid
from moe_ep.tuning.cache import arch_of
from moe_ep.tuning.knobs import cpu_thread_candidates, portable_grid

FORMATS = (
    "any_bf16_bf16_bf16_torch",
    "any_fp8_fp8_bf16_torch",
    "any_mxfp8_mxfp8_bf16_torch",
    "any_nvfp4_nvfp4_bf16_torch",
    "any_fp8_fp4_bf16_torch",
    "any_fp8_mxfp4_bf16_torch",
    "any_fp8_nvfp4_bf16_torch",
    "any_mxfp8_mxfp4_bf16_torch",
)
T, H, I, E, K = 40, 256, 128, 4, 2  # noqa: E741 - the layer's names
"""20 pairs per expert on average; H and I multiples of 128 for every format."""

needs_two_cpus = pytest.mark.skipif(usable_cpus() < 2, reason="needs 2 usable CPUs")


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _problem(seed: int = 0, t: int = T, h: int = H, inter: int = I) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    i = inter
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    ids[: t // 2, 0] = E - 1  # a hot expert: more rows than the others
    return {
        "x": torch.randn(t, h, generator=g).bfloat16(),
        "ids": ids,
        "w": torch.rand(t, K, generator=g),
        "w13": (torch.randn(E, 2 * i, h, generator=g) / h**0.5).bfloat16(),
        "w2": (torch.randn(E, h, i, generator=g) / i**0.5).bfloat16(),
    }


def _forward(kernel: str, p: dict[str, torch.Tensor], **fields: Any) -> torch.Tensor:
    """One EP1 forward of `kernel` configured with `fields`."""
    config = get_kernel(kernel).config_cls(**fields)
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    t, h = (int(d) for d in p["x"].shape)
    layer = MoEEpLayer(boot, FleetParams(E, t, h), MoEWeightPack(p["w13"], p["w2"]), config)
    try:
        return layer(MoEEpTensors(p["x"], p["ids"], p["w"])).clone()
    finally:
        layer.destroy()


# --- cpu_threads: a knob ----------------------------------------------------------------------


@needs_two_cpus
@pytest.mark.parametrize("kernel", FORMATS)
@pytest.mark.parametrize("gemm_rows", [None, 0], ids=["default_path", "mm_blocks"])
def test_cpu_threads_do_not_change_the_bits(kernel: str, gemm_rows: int | None) -> None:
    if not portable_kernel.thread_count_keeps_bits():
        pytest.skip("no fused CPU library with OpenMP: the bits may depend on the thread count")
    p = _problem()
    counts = sorted({1, 2, usable_cpus()})
    outs = [_forward(kernel, p, cpu_threads=n, expert_gemm_rows=gemm_rows) for n in counts]
    assert all(torch.isfinite(y).all() for y in outs)
    for n, y in zip(counts[1:], outs[1:], strict=True):
        assert torch.equal(y, outs[0]), f"{kernel}: cpu_threads={n} differs from 1"


@needs_two_cpus
def test_cpu_threads_is_set_for_the_forward_and_restored_also_on_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, int] = {}
    real_plan, real_run = comm.plan_dispatch, experts.run_experts

    def plan(*args: Any, **kw: Any) -> Any:
        seen["stage"] = torch.get_num_threads()
        return real_plan(*args, **kw)

    def run(*args: Any, **kw: Any) -> None:
        seen["experts"] = torch.get_num_threads()
        real_run(*args, **kw)

    monkeypatch.setattr(comm, "plan_dispatch", plan)
    monkeypatch.setattr(experts, "run_experts", run)
    torch.set_num_threads(2)
    _forward(FORMATS[0], _problem(), cpu_threads=1)
    assert seen == {"stage": 1, "experts": 1}
    assert torch.get_num_threads() == 2
    _forward(FORMATS[0], _problem())  # None: the caller's count
    assert seen == {"stage": 2, "experts": 2}

    def fail(*args: Any, **kw: Any) -> None:
        seen["experts"] = torch.get_num_threads()
        raise RuntimeError("planted")

    monkeypatch.setattr(experts, "run_experts", fail)
    with pytest.raises(RuntimeError, match="planted"):
        _forward(FORMATS[0], _problem(), cpu_threads=1)
    assert seen["experts"] == 1 and torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, True, 1.0, "2", usable_cpus() + 1])
def test_cpu_threads_refuses_bad_values(bad: object) -> None:
    with pytest.raises(MoeEpUsageError) as info:
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(cpu_threads=bad)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"cpu_threads must be None or an int from 1 to the {usable_cpus()} usable CPUs, got {bad!r}"
    )


def _kernel_on(device: torch.device, **fields: Any) -> Any:
    """A bf16 portable kernel built on a fake runtime of `device` (nothing collective)."""
    p = _problem()
    return portable_kernel.Bf16TorchKernel(
        config=Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(**fields),
        fleet=FleetParams(E, T, H),
        runtime=SimpleNamespace(world_size=1, rank=0, device=device),  # type: ignore[arg-type]
        weights=MoEWeightPack(p["w13"], p["w2"]),
    )


def test_cpu_threads_is_refused_off_the_cpu() -> None:
    with pytest.raises(MoeEpUsageError, match=r"cpu_threads=1 sets the threads of a CPU forward"):
        _kernel_on(torch.device("cuda", 0), cpu_threads=1)


# --- expert_gemm_rows: an explicit field, not a knob ------------------------------------------


def test_expert_gemm_rows_chooses_the_path_and_the_paths_give_different_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The evidence that the crossover cannot be a knob: the same bf16 forward through the
    CPU expert GEMM and through the `mm` blocks differs in the last bits (different sum
    orders: on the AVX2 box 15 of 65536 outputs at H=1024 I=512, none at H=256, where
    torch's K blocking does not show; every bf16 expert of 3+ rows where the CPU has
    AVX-512 BF16, docs/layer.md); both are within the format's contract
    (`tests/layer/test_expert_gemm.py`, the oracle tests)."""
    if experts.expert_gemm_rows(_prepared(), torch.device("cpu")) == 0:
        pytest.skip("no CPU expert GEMM here (no fused library)")
    calls = {"gemm": 0, "blocks": 0}
    real_gemm, real_blocks = experts._run_expert_gemm, experts._run_blocks

    def gemm(*args: Any, **kw: Any) -> None:
        calls["gemm"] += 1
        real_gemm(*args, **kw)

    def blocks(*args: Any, **kw: Any) -> None:
        calls["blocks"] += 1
        real_blocks(*args, **kw)

    monkeypatch.setattr(experts, "_run_expert_gemm", gemm)
    monkeypatch.setattr(experts, "_run_blocks", blocks)
    torch.set_num_threads(1)  # one `_run_blocks` call for all blocks: countable
    p = _problem(1, t=64, h=1024, inter=512)
    outs = {}
    for rows in (0, 4096):
        calls.update(gemm=0, blocks=0)
        outs[rows] = _forward(FORMATS[0], p, expert_gemm_rows=rows)
        assert calls == ({"gemm": 0, "blocks": 1} if rows == 0 else {"gemm": 1, "blocks": 0})
    calls.update(gemm=0, blocks=0)
    _forward(FORMATS[0], p, expert_gemm_rows=int(torch.bincount(p["ids"].flatten()).min()))
    assert calls == {"gemm": 1, "blocks": 1}  # the fewest-row expert below, the hot one above
    assert not torch.equal(outs[0], outs[4096])


def _prepared() -> Any:
    from moe_ep.backends.portable.recipes import Bf16Recipe

    p = _problem()
    return Bf16Recipe().prepare(MoEWeightPack(p["w13"], p["w2"]))


@pytest.mark.parametrize("bad", [-1, True, 2.0, "8"])
def test_expert_gemm_rows_refuses_bad_values(bad: object) -> None:
    with pytest.raises(MoeEpUsageError) as info:
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(expert_gemm_rows=bad)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"expert_gemm_rows must be None (the measured default) or an int >= 0, got {bad!r}"
    )


def test_expert_gemm_rows_is_refused_with_capture_safe() -> None:
    with pytest.raises(MoeEpUsageError, match=r"expert_gemm_rows=0 is not read by the capture"):
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(expert_gemm_rows=0, capture_safe=True)


def test_expert_gemm_rows_is_refused_where_the_expert_gemm_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(portable_kernel, "expert_gemm_unavailable", lambda w, d: "planted")
    with pytest.raises(MoeEpUsageError) as info:
        _kernel_on(torch.device("cpu"), expert_gemm_rows=8)
    assert str(info.value) == (
        "expert_gemm_rows=8 needs the CPU expert GEMM, which cannot run here: planted; leave "
        "it None (the default) or 0"
    )
    assert _kernel_on(torch.device("cpu"), expert_gemm_rows=0).expert_gemm_rows == 0
    # the real check: off the CPU there is no expert GEMM
    assert "not the CPU" in str(experts.expert_gemm_unavailable(_prepared(), torch.device("meta")))


def test_expert_gemm_rows_default_is_the_measured_crossover() -> None:
    k = _kernel_on(torch.device("cpu"))
    assert k.expert_gemm_rows == experts.expert_gemm_rows(k.prepared, torch.device("cpu"))
    assert _kernel_on(torch.device("cpu"), expert_gemm_rows=5).expert_gemm_rows == 5


# --- the grid ---------------------------------------------------------------------------------


def test_thread_candidates_are_powers_of_two_below_the_share_after_the_default() -> None:
    assert cpu_thread_candidates(1) == (None,)
    assert cpu_thread_candidates(2) == (None, 1)
    assert cpu_thread_candidates(6) == (None, 1, 2, 4)
    assert cpu_thread_candidates(8) == (None, 1, 2, 4)
    assert cpu_thread_candidates(9) == (None, 1, 2, 4, 8)


def test_portable_grid_has_the_thread_knob_at_every_world_size() -> None:
    assert portable_grid(1, cpus=8) == {"cpu_threads": (None, 1, 2, 4)}
    assert portable_grid(2, cpus=8) == {"dedup": (True, False), "cpu_threads": (None, 1, 2)}
    assert portable_grid(None, cpus=8) == {
        "dedup": (True, False),
        "cpu_threads": (None, 1, 2, 4),
    }
    fields = {f.name for f in dataclasses.fields(Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig)}
    assert set(portable_grid(None)) <= fields
    assert "expert_gemm_rows" in fields and "expert_gemm_rows" not in portable_grid(None)


def test_the_thread_knob_is_dropped_where_threads_change_the_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel_cls = get_kernel(FORMATS[0])
    monkeypatch.setattr(portable_kernel, "thread_count_keeps_bits", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    share = max(1, usable_cpus() // 2)
    assert len(valid_grid(kernel_cls, 2)) == 2 * len(cpu_thread_candidates(share))
    assert not arch_of(None).endswith(":eager")
    monkeypatch.setattr(portable_kernel, "thread_count_keeps_bits", lambda: False)
    assert valid_grid(kernel_cls, 2) == [
        {"dedup": True, "cpu_threads": None},
        {"dedup": False, "cpu_threads": None},
    ]
    assert valid_grid(kernel_cls, 1) == [{"cpu_threads": None}]
    assert arch_of(None).endswith(":eager")  # a winner tuned with the library is not read

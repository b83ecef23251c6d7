"""The portable kernel's cache-sized slicing (expert row blocks, SwiGLU slices, combine
token slices) changes nothing: checked in process against direct formulas."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import pytest
import torch
import torch.nn.functional as F

from moe_ep.backends.portable import comm, experts
from moe_ep.backends.portable.recipes import Bf16Recipe
from moe_ep.types import MoEWeightPack


def _has_cpu_grouped_mm() -> bool:
    """Whether this torch runs `torch._grouped_mm` on CPU (2.8 has it for CUDA only)."""
    try:
        torch._grouped_mm(
            torch.zeros(1, 8, dtype=torch.bfloat16),
            torch.zeros(1, 8, 8, dtype=torch.bfloat16),
            offs=torch.tensor([1], dtype=torch.int32),
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


NO_CPU_GROUPED_MM = (
    None if _has_cpu_grouped_mm() else f"torch {torch.__version__} has no CPU torch._grouped_mm"
)


def _copy_into(h: torch.Tensor, out: torch.Tensor) -> None:
    """A requantize that only rounds: h copied into the FC2 input."""
    out.copy_(h)


def _combine_direct(y: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`y [n, k, H]` bf16 per (token, slot): bf16(fp32 sum in slot order of w * y)."""
    n, k, h = y.shape
    acc = torch.zeros(n, h)
    for j in range(k):
        term = torch.where((ids[:, j] >= 0).unsqueeze(1), w[:, j : j + 1] * y[:, j].float(), 0.0)
        acc = acc + term
    return acc.bfloat16()


@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("slice_bytes", [1, 3 * 4 * 40 * 4, 1 << 20])
def test_combine_is_exact_for_any_token_slicing(
    monkeypatch: pytest.MonkeyPatch, slice_bytes: int, k: int
) -> None:
    g = torch.Generator().manual_seed(7)
    n, h, e = 37, 40, 5
    ids = torch.randint(0, e, (n, k), generator=g)
    ids[torch.rand(n, k, generator=g) < 0.2] = -1
    ids[4] = -1  # a token with no valid slot
    w = torch.rand(n, k, generator=g)
    y_all = torch.randn(n, k, h, generator=g).bfloat16()
    plan = comm.plan_dispatch(ids, e, 1, True)
    # pair p (send order) holds the row of its (token, slot)
    y_pairs = y_all[plan.pair_token, plan.pair_slot]
    monkeypatch.setattr(comm, "COMBINE_BYTES", slice_bytes)
    out = torch.empty(n, h, dtype=torch.bfloat16)
    comm.combine(y_pairs, plan, w, out, workspace=comm.Workspace())
    assert torch.equal(out, _combine_direct(y_all, ids, w))
    assert torch.equal(out[4].view(torch.int16), torch.zeros(h, dtype=torch.int16))


def test_expert_blocks_and_swiglu_slices_match_a_per_expert_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(3)
    e, h, inter, rows_n = 3, 32, 48, 20
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16()
    rows = torch.randn(rows_n, h, generator=g).bfloat16()
    counts = [11, 0, 6]
    src_row = torch.randint(0, rows_n, (sum(counts),), generator=g)
    prepared = Bf16Recipe().prepare(MoEWeightPack(w13, w2))
    # reference: each expert's rows in one mm (the blocks below are all one block here)
    expected = torch.empty(sum(counts), h, dtype=torch.bfloat16)
    start = 0
    for x, c in enumerate(counts):
        xe = rows[src_row[start : start + c]]
        gu = xe @ w13[x].t()
        hid = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).bfloat16()
        expected[start : start + c] = hid @ w2[x].t()
        start += c
    monkeypatch.setattr(experts, "SWIGLU_ROWS", 4)  # several SwiGLU slices per block
    for requantize in (None, _copy_into):  # rounding fused into the product, or a copy
        y = torch.empty_like(expected)
        experts.run_experts(rows, src_row, counts, prepared, requantize, None, y, comm.Workspace())
        assert torch.equal(y, expected)
    # expert row blocks of 4: another GEMM blocking, same math (oneDNN may round differently
    # for another M, so compare each block against its own reference)
    monkeypatch.setattr(experts, "ROW_BLOCK", 4)
    y4 = torch.empty_like(expected)
    experts.run_experts(rows, src_row, counts, prepared, _copy_into, None, y4, comm.Workspace())
    start = 0
    for x, c in enumerate(counts):
        for s in range(start, start + c, 4):
            b = min(4, start + c - s)
            xe = rows[src_row[s : s + b]]
            gu = xe @ w13[x].t()
            hid = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).bfloat16()
            assert torch.equal(y4[s : s + b], hid @ w2[x].t()), (x, s)
        start += c


@pytest.mark.multirank
def test_bf16_large_expert_blocks_bit_identical_across_world_sizes() -> None:
    """Experts with more rows than `ROW_BLOCK` (two blocks each)
    give the same bits at EP1 and EP2, and match the oracle."""
    from layer_cases import Case, cases_worker, from_wire, make_problem

    from moe_ep.oracle import compare_to_oracle, oracle_forward
    from moe_ep.spawn import spawn_local

    case = Case("big_blocks", tokens=2600, hidden=64, inter=32, experts=2, topk=2, seed=9)
    assert case.tokens * case.topk // case.experts > experts.ROW_BLOCK  # two blocks each
    outs = {}
    for ws in (1, 2):
        res = spawn_local(cases_worker, ws, [(case, "bf16")], False, timeout_s=120)
        outs[ws] = torch.cat([from_wire(r["out"]["big_blocks/bf16"]) for r in res])
    assert torch.equal(outs[1], outs[2])
    p = make_problem(case, 1)
    ref = oracle_forward(p["x"], p["ids"], p["topk_weights"], p["w13"], p["w2"], fmt="bf16")
    report = compare_to_oracle(outs[1], ref)
    assert report.ok, str(report)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("requantize", [None, "half_step"])
@pytest.mark.parametrize(("alpha", "clamp"), [(None, None), (0.75, 1.5)])
def test_swiglu_slices_match_the_direct_formula(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    requantize: str | None,
    alpha: float | None,
    clamp: float | None,
) -> None:
    """Every SwiGLU branch (GEMM output widened or used in place, rounding fused or through
    a requantize function, alpha and clamp) gives the bits of the unsliced fp32 formula."""
    monkeypatch.setattr(experts, "SWIGLU_ROWS", 3)
    g = torch.Generator().manual_seed(11)
    b, inter = 10, 24
    gu = (torch.randn(b, 2 * inter, generator=g) * 3).to(dtype)

    def half_step(t: torch.Tensor) -> torch.Tensor:  # a stand-in quantizer: a 0.5 grid
        return torch.round(t * 2) / 2

    rq = None if requantize is None else half_step
    part = gu.float().clone()  # worked on in place: silu sees rows of `inter` like the kernel
    if alpha is not None:
        part.mul_(alpha)
    gate, up = part[:, :inter], part[:, inter:]
    if clamp is not None:
        # in place: ATen's vectorized silu and its per-row tail may differ in the last fp32
        # bit, so the reference keeps the kernel's [b, inter]-rows layout (fixed by I alone)
        gate.clamp_(max=clamp)
        up.clamp_(-clamp, clamp)
    prod = F.silu(gate) * up
    expected = (prod if rq is None else rq(prod)).to(dtype)
    h = torch.empty(b, inter, dtype=dtype)
    into = None if rq is None else lambda t, out: out.copy_(rq(t))
    experts._swiglu(gu.clone(), h, alpha, clamp, into, comm.Workspace())
    assert torch.equal(h, expected)


@pytest.mark.parametrize("clamp", [None, 1.5])
def test_grouped_mm_branch_matches_the_per_expert_loop(
    monkeypatch: pytest.MonkeyPatch, clamp: float | None
) -> None:
    """The CUDA branch (`torch._grouped_mm`, int32 offsets), forced on CPU, against the loop
    of `mm` blocks: same rows, empty experts included; on CPU both give the same bits."""
    if NO_CPU_GROUPED_MM:
        pytest.skip(NO_CPU_GROUPED_MM)
    g = torch.Generator().manual_seed(11)
    e, h, inter, rows_n = 4, 64, 32, 24
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16()
    rows = torch.randn(rows_n, h, generator=g).bfloat16()
    counts = [9, 0, 13, 5]
    src_row = torch.randint(0, rows_n, (sum(counts),), generator=g)
    prepared = Bf16Recipe().prepare(MoEWeightPack(w13, w2))
    assert not experts.grouped_mm_applies(prepared, rows.device)  # CPU: the loop
    # the loop's `mm` blocks, not the CPU expert GEMM (its own sum order) that the crossover
    # sends these few-row experts to where the fused library runs
    monkeypatch.setattr(experts, "expert_gemm_rows", lambda w, d: 0)
    monkeypatch.setattr(experts, "amx_for_quantized", lambda w, d: False)
    # the blocks' bf16 GEMM, which the grouped branch runs too (without oneDNN bf16 the
    # blocks widen to fp32 instead: another order, tests/layer/test_mm_widened.py)
    monkeypatch.setattr(experts, "_onednn_bf16", lambda: True)
    loop = torch.empty(sum(counts), h, dtype=torch.bfloat16)
    experts.run_experts(rows, src_row, counts, prepared, None, clamp, loop, comm.Workspace())
    calls: list[torch.Tensor] = []
    real = torch._grouped_mm

    def spy(a: torch.Tensor, b: torch.Tensor, *, offs: torch.Tensor) -> torch.Tensor:
        calls.append(offs)
        return real(a, b, offs=offs)

    monkeypatch.setattr(experts, "grouped_mm_applies", lambda w, d: True)
    monkeypatch.setattr(torch, "_grouped_mm", spy)
    grouped = torch.empty_like(loop)
    experts.run_experts(rows, src_row, counts, prepared, None, clamp, grouped, comm.Workspace())
    assert len(calls) == 2
    assert all(o.dtype == torch.int32 and o.tolist() == [9, 9, 22, 27] for o in calls)
    diff = (grouped.float() - loop.float()).abs()
    assert torch.equal(grouped, loop), float(diff.max())


def test_task_queue_hands_each_task_to_one_thread_largest_first() -> None:
    tasks = [(e % 7, 3 * e, 1 + (e * 37) % 11) for e in range(2000)]
    queue = experts._TaskQueue(tasks)
    taken: list[list[tuple[int, int, int]]] = [[] for _ in range(4)]
    start = threading.Barrier(4)

    def drain(i: int) -> None:
        start.wait()
        for task in queue:
            taken[i].append(task)

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = [task for part in taken for task in part]
    assert sorted(got) == sorted(tasks)  # each exactly once
    assert all(part == sorted(part, key=lambda t: -t[2]) for part in taken)  # largest first
    assert list(queue) == []


@pytest.mark.parametrize(
    "counts", [[40, 0, 25, 31, 7], [300, 2, 1, 0, 3], [0, 0, 90, 0, 0]], ids=["mixed", "hot", "one"]
)
def test_expert_blocks_split_over_threads_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, counts: list[int]
) -> None:
    """Blocks spread over worker threads (one OpenMP thread each) write exactly what the
    sequential loop writes, skewed and single-expert routing included."""
    g = torch.Generator().manual_seed(5)
    e, h, inter = len(counts), 64, 48
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16()
    rows = torch.randn(50, h, generator=g).bfloat16()
    src_row = torch.randint(0, 50, (sum(counts),), generator=g)
    prepared = Bf16Recipe().prepare(MoEWeightPack(w13, w2))
    monkeypatch.setattr(experts, "ROW_BLOCK", 64)  # the hot expert spans several blocks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(experts.cpu_fused, "parallel_workers", lambda d: 1)
        want = torch.empty(sum(counts), h, dtype=torch.bfloat16)
        experts.run_experts(rows, src_row, counts, prepared, None, None, want, comm.Workspace())
        for workers in (2, 3):
            monkeypatch.setattr(experts.cpu_fused, "parallel_workers", lambda d, n=workers: n)
            got = torch.full_like(want, float("nan"))
            experts.run_experts(rows, src_row, counts, prepared, None, None, got, comm.Workspace())
            assert torch.equal(got, want), workers
    finally:
        torch.set_num_threads(threads)


def test_a_failing_worker_block_raises_in_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    real = experts._run_blocks

    def flaky(tasks: Iterable[tuple[int, int, int]], *args: object, **kwargs: object) -> None:
        for task in tasks:
            if task[0] == 2:
                raise RuntimeError("block of expert 2 failed")
            real([task], *args, **kwargs)  # type: ignore[arg-type]

    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(3, 16, 8, generator=g).bfloat16()
    w2 = torch.randn(3, 8, 8, generator=g).bfloat16()
    prepared = Bf16Recipe().prepare(MoEWeightPack(w13, w2))
    monkeypatch.setattr(experts.cpu_fused, "parallel_workers", lambda d: 3)
    monkeypatch.setattr(experts, "_run_blocks", flaky)
    monkeypatch.setattr(experts, "expert_gemm_rows", lambda w, d: 0)  # the blocks path only
    monkeypatch.setattr(experts, "amx_for_quantized", lambda w, d: False)
    y = torch.empty(6, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="block of expert 2 failed"):
        experts.run_experts(
            torch.randn(4, 8).bfloat16(), torch.tensor([0, 1, 2, 3, 0, 1]), [2, 2, 2],
            prepared, None, None, y, comm.Workspace(),
        )  # fmt: skip


@pytest.mark.parametrize(("h", "inter", "ok"), [(64, 48, True), (100, 48, False), (64, 36, False)])
def test_grouped_mm_only_gets_operands_it_accepts(h: int, inter: int, ok: bool) -> None:
    """`torch._grouped_mm` wants every stride a multiple of 16 bytes (H, I multiples of 8 in
    bf16); the CUDA branch is taken only then, else the per-expert loop runs."""
    g = torch.Generator().manual_seed(2)
    w13 = (torch.randn(3, 2 * inter, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(3, h, inter, generator=g) / inter**0.5).bfloat16()
    prepared = Bf16Recipe().prepare(MoEWeightPack(w13, w2))
    assert experts._grouped_mm_operands_ok(prepared) is ok
    if NO_CPU_GROUPED_MM:
        pytest.skip(NO_CPU_GROUPED_MM)
    rows = torch.randn(8, h, generator=g).bfloat16()
    offs = torch.tensor([3, 5, 8], dtype=torch.int32)
    if ok:
        torch._grouped_mm(rows, prepared.w13t, offs=offs)
    else:  # what the check spares the caller
        with pytest.raises(RuntimeError, match="16 bytes"):
            gu = torch._grouped_mm(rows, prepared.w13t, offs=offs)
            torch._grouped_mm(gu[:, :inter].contiguous(), prepared.w2t, offs=offs)

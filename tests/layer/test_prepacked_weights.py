"""`PortableConfig.cpu_prepacked_weights`: the bf16 `mm` blocks on oneDNN's prepacked weight
layout give `torch.mm`'s bits (the forward's outputs unchanged); where torch has no oneDNN
bf16 GEMMs (AVX2 CPUs) the expert GEMM reads weights packed for the k order (its bits: the
unpacked default's for experts of `KSEQ_ROWS`+ rows); and the field is honoured or refused:
never accepted and ignored."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable import cpu_fused, experts
from moe_ep.backends.portable.comm import Workspace
from moe_ep.backends.portable.configs import Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig
from moe_ep.backends.portable.recipes import Bf16Recipe
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.registry import get_kernel
from moe_ep.spawn import free_port

needs_onednn = pytest.mark.skipif(
    not experts._onednn_bf16(),
    reason="torch has no oneDNN bf16 GEMMs on this CPU: nothing to prepack",
)
_CPU = torch.device("cpu")
needs_prepacking = pytest.mark.skipif(
    experts.prepack_host_unavailable(_CPU) is not None,
    reason=f"no prepacking here: {experts.prepack_host_unavailable(_CPU)}",
)
needs_kpack = pytest.mark.skipif(
    experts._onednn_bf16() or experts.prepack_host_unavailable(_CPU) is not None,
    reason="the k-order packing applies where torch has no oneDNN bf16 GEMMs and the fused "
    "library's AVX2 k order is the default (AVX2 without AVX-512F)",
)


def _weights(e: int, h: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).bfloat16()
    return w13, w2


@needs_onednn
@pytest.mark.parametrize(("k", "n"), [(8, 40), (100, 8), (768, 2048), (2048, 1536)])
def test_prepacked_gemm_gives_torch_mm_bits_from_two_rows(k: int, n: int) -> None:
    """At one intra-op thread, as the layer's `mm` blocks run beside each other with the
    fused library: with two, oneDNN's AMX kernels split the packed and the plain GEMM
    differently (K = 2048 N = 1536: 3-12 outputs differ at 33-65 rows; docs/layer.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _packed_against_mm(k, n)
    finally:
        torch.set_num_threads(before)


def _packed_against_mm(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    pack = MoEWeightPack(w[None], torch.zeros(1, k, n // 2).bfloat16())  # FC1's weight: w
    packed = experts.prepack(Bf16Recipe().prepare(pack))
    assert packed.packed13 is not None
    for m in [experts.PACKED_MIN_ROWS, 3, 7, 16, 17, 33, 64, 65, 130, 257]:
        x = torch.randn(m, k, generator=g).bfloat16()
        out = torch.empty(m, n, dtype=torch.bfloat16)
        experts._mm_packed(x, packed.packed13[0], out)
        assert torch.equal(out, torch.mm(x, w.t())), m


@needs_onednn
def test_mm_blocks_on_prepacked_weights_give_the_same_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every expert through the `mm` blocks (ragged: empty, 1 and 2 rows, a block split
    leaving 1 row), FC1 K = 2048 N = 1536: the prepacked run is bit-identical to the plain
    one and really ran on the packed weights (from 2 rows) and on `torch.mm` (1 row)."""
    e, h, inter = 7, 2048, 768
    w13, w2 = _weights(e, h, inter, 5)
    plain = Bf16Recipe().prepare(MoEWeightPack(w13, w2))
    packed = experts.prepack(plain)
    g = torch.Generator().manual_seed(6)
    counts = [0, 1, 2, 3, 17, 64, 41]
    rows = torch.randn(60, h, generator=g).bfloat16()
    src_row = torch.randint(0, 60, (sum(counts),), generator=g)
    monkeypatch.setattr(experts, "ROW_BLOCK", 40)  # 64 -> 40 + 24, 41 -> 40 + 1
    real, sizes = experts._mm_packed, []

    def counted(a: torch.Tensor, p: torch.Tensor, out: torch.Tensor) -> None:
        sizes.append(int(a.shape[0]))
        real(a, p, out)

    monkeypatch.setattr(experts, "_mm_packed", counted)
    outs = []
    for weights in (plain, packed):
        y = torch.empty(sum(counts), h, dtype=torch.bfloat16)
        experts.run_experts(rows, src_row, counts, weights, None, None, y, Workspace(), gemm_rows=0)
        outs.append(y)
    assert sorted(sizes) == sorted(2 * [2, 3, 17, 40, 24, 40])  # FC1 and FC2; no 1-row block
    assert torch.equal(outs[0], outs[1])


def _forward(
    prepacked: bool | None,
    h: int = 256,
    inter: int = 128,
    e: int = 4,
    t: int = 96,
    kernel: str = "any_bf16_bf16_bf16_torch",
    fmt: str = "bf16",
    **fields: Any,
) -> tuple[torch.Tensor, Any]:
    """A forward of t tokens, top-2 of e experts (t=96, e=4: 48 rows per expert on average,
    every expert at least `KSEQ_ROWS`) on `kernel` with config `fields`; its prepared
    weights and the oracle of format `fmt` with the same `fields` (those it takes)."""
    g = torch.Generator().manual_seed(2)
    k = 2
    w13, w2 = _weights(e, h, inter, 3)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    x, w = torch.randn(t, h, generator=g).bfloat16(), torch.rand(t, k, generator=g)
    cls: Any = get_kernel(kernel)
    config = cls.config_cls(cpu_prepacked_weights=prepacked, **fields)
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    layer = MoEEpLayer(boot, FleetParams(e, t, h), MoEWeightPack(w13, w2), config)
    try:
        out = layer(MoEEpTensors(x, ids, w)).clone()
        ref = oracle_forward(x, ids, w, w13, w2, fmt=fmt, **fields)
        return out, (layer._kernel.prepared, ref)  # type: ignore[attr-defined]
    finally:
        layer.destroy()


@needs_prepacking
def test_the_layer_with_prepacked_weights_gives_the_same_bits() -> None:
    off, (plain, _) = _forward(False)
    on, (packed, _) = _forward(True)
    assert plain.packed13 is None and plain.kpack13 is None
    if experts._onednn_bf16():
        assert packed.packed13 is not None and len(packed.packed2) == 4
    else:
        assert packed.kpack13 is not None and packed.kpack2 is not None
        assert packed.kpack13.n == 256 and packed.kpack2.n == 256  # 2I, H
    assert torch.equal(on, off)


@needs_kpack
def test_decode_on_k_order_packing_reads_the_packed_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Few rows per expert (16 tokens, top-2 of 16 experts): the expert GEMM reads the
    packed weights (FC1 and FC2), the outputs within the oracle's bound."""
    real, seen = cpu_fused.expert_gemm, []

    def recorded(*args: Any, **kwargs: Any) -> bool:
        seen.append(type(args[3]).__name__)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_fused, "expert_gemm", recorded)
    out, (packed, ref) = _forward(True, h=512, inter=256, e=16, t=16)
    assert packed.kpack13 is not None
    assert seen and set(seen) == {"PackedK16"}, seen
    report = compare_to_oracle(out, ref)
    assert report.ok, report


@needs_onednn
def test_without_the_fused_library_prepacked_weights_stay_within_the_oracle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `MOE_EP_CPU_FUSED=0` each `mm` block runs on torch's 2 threads, where oneDNN's
    AMX kernels split the packed and the plain GEMM differently (K = 2048): other bits are
    allowed there (docs/layer.md), not other results."""
    monkeypatch.setattr(cpu_fused, "library", lambda: None)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = [_forward(p, h=2048, inter=768) for p in (False, True)]
    finally:
        torch.set_num_threads(before)
    for out, (_, ref) in outs:
        report = compare_to_oracle(out, ref)
        assert report.ok, report


def _kernel(name: str, device: torch.device, **fields: Any) -> Any:
    cls: Any = get_kernel(name)
    w13, w2 = _weights(2, 128, 128, 0)
    return cls(
        config=cls.config_cls(cpu_prepacked_weights=True, **fields),
        fleet=FleetParams(2, 8, 128),
        runtime=SimpleNamespace(world_size=1, rank=0, device=device),
        weights=MoEWeightPack(w13, w2),
    )


def test_prepacking_is_refused_where_it_cannot_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(experts, "_onednn_bf16", lambda: True)  # the format decides
    assert experts.prepack_layout(cpu) == "onednn"
    with pytest.raises(MoeEpUsageError) as info:
        _kernel("any_fp8_fp8_bf16_torch", cpu)
    assert str(info.value) == (
        "cpu_prepacked_weights=True cannot apply here: the FC1 / FC2 weights are "
        "torch.float32 / torch.float32, not bf16; leave it None or False"
    )
    with pytest.raises(MoeEpUsageError, match=r"FC1 / FC2 weights are torch.float32 / torch.bfl"):
        _kernel("any_bf16_bf16_bf16_torch", cpu, fc1_output_high_precision=True)
    monkeypatch.setattr(experts, "_onednn_bf16", lambda: False)
    monkeypatch.setattr(cpu_fused, "kseq_by_default", lambda: False)
    with pytest.raises(
        MoeEpUsageError,
        match=r"cannot apply here: torch has no oneDNN bf16 GEMMs on this CPU and the fused CPU "
        r"library's AVX2 k order is not its default here \(vector bodies 0x[0-9a-f]+: it needs "
        r"AVX2 without AVX-512F\); leave it None or False",
    ):
        _kernel("any_bf16_bf16_bf16_torch", cpu)
    assert experts.prepack_layout(cpu) is None
    monkeypatch.setattr(cpu_fused, "kseq_by_default", lambda: True)  # the k-order packing
    assert experts.prepack_layout(cpu) == "k16"
    monkeypatch.setattr(cpu_fused, "library", lambda: None)
    with pytest.raises(
        MoeEpUsageError, match=r"cannot apply here: the fused CPU library is not loaded"
    ):
        _kernel("any_bf16_bf16_bf16_torch", cpu)
    plain = Bf16Recipe().prepare(MoEWeightPack(*_weights(1, 8, 8, 0)))
    assert "not the CPU" in str(experts.prepack_unavailable(plain, torch.device("meta")))


QUANTIZED = {
    "any_fp8_fp8_bf16_torch": "fp8",
    "any_mxfp8_mxfp8_bf16_torch": "mxfp8",
    "any_nvfp4_nvfp4_bf16_torch": "nvfp4",
    "any_fp8_fp4_bf16_torch": "fp8_fp4",
    "any_fp8_mxfp4_bf16_torch": "fp8_mxfp4",
    "any_fp8_nvfp4_bf16_torch": "fp8_nvfp4",
    "any_mxfp8_mxfp4_bf16_torch": "mxfp8_mxfp4",
}
"""The quantized formats: their dequantized weights are exact in bf16 (by `cpu_fused.
exact_in_bf16` of their stored codes and scales) but for fp8's (fp32 block scales), whose
codes pack instead."""


@needs_kpack
@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_formats_run_on_the_packed_copy(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their dequantized weights packed in bf16 (the same values), fp8's codes and scales: a
    decode shape reads the packed copy for both GEMMs (fp32 activations) and stays within
    the format's oracle; the packed copy's values are the unpacked layer's."""
    real, seen = cpu_fused.expert_gemm, []

    def recorded(*args: Any, **kwargs: Any) -> bool:
        seen.append((type(args[3]).__name__, args[0].dtype))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_fused, "expert_gemm", recorded)
    shape = {"h": 512, "inter": 256, "e": 16, "t": 16, "kernel": name, "fmt": QUANTIZED[name]}
    out, (prepared, ref) = _forward(None, **shape)  # type: ignore[arg-type]
    assert prepared.kpack13 is not None and prepared.kpack2 is not None
    assert prepared.w13t is None and prepared.w2t is None  # replaced by the packed copy,
    assert prepared.stored13 is None and prepared.stored2 is None  # the codes too
    assert seen and set(seen) == {("PackedK16", torch.float32)}, seen
    report = compare_to_oracle(out, ref)
    assert report.ok, report
    _, (plain, _) = _forward(False, **shape)  # type: ignore[arg-type]
    assert plain.kpack13 is None and plain.w13t.dtype == torch.float32
    assert prepared.kpack13.code == ("e4m3" if name == "any_fp8_fp8_bf16_torch" else "bf16")
    for packed, dense, e, j in (
        (prepared.kpack13, plain.w13t, 3, 16),
        (prepared.kpack2, plain.w2t, 2, 48),
    ):
        values = torch.full((16, packed.k), float("nan"))
        packed.widen(e, j, 16, values)
        assert torch.equal(values, dense[e, :, j : j + 16].t()), (e, j)


def _held_bytes(prepared: Any, given: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the distinct storages a `PreparedWeights` holds, not counting the caller's
    tensors `given` (bf16 weights are kept as views of them where they are not packed)."""
    theirs = {t.untyped_storage().data_ptr() for t in given}
    seen: dict[int, int] = {}
    for value in vars(prepared).values():
        for t in [value, *(getattr(value, f, None) for f in ("codes", "scales"))]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in theirs:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@needs_kpack
@pytest.mark.parametrize(
    ("kernel", "fields", "packs"),
    [
        ("any_mxfp8_mxfp8_bf16_torch", {}, True),
        ("any_nvfp4_nvfp4_bf16_torch", {}, True),
        ("any_bf16_bf16_bf16_torch", {"fc1_output_high_precision": True}, True),
        ("any_bf16_bf16_bf16_torch", {}, False),  # a second copy of the caller's weights
        ("any_fp8_fp8_bf16_torch", {}, True),  # its codes
        ("any_mxfp8_mxfp8_bf16_torch", {"expert_gemm_rows": 0}, False),  # nothing would read it
    ],
)
def test_the_default_packs_where_that_takes_less_memory(
    kernel: str, fields: dict[str, Any], packs: bool
) -> None:
    """`cpu_prepacked_weights=None` packs (the copy replacing the layer's own weights) where
    those held an fp32 FC1, and then holds fewer bytes than `False`; elsewhere it is False."""
    cls: Any = get_kernel(kernel)
    held = {}
    for pack in (None, False):
        w13, w2 = _weights(4, 256, 128, 0)
        k = cls(
            config=cls.config_cls(cpu_prepacked_weights=pack, **fields),
            fleet=FleetParams(4, 8, 256),
            runtime=SimpleNamespace(world_size=1, rank=0, device=_CPU),
            weights=MoEWeightPack(w13, w2),
        )
        p = k.prepared
        assert (p.kpack13 is not None) == (packs and pack is None)
        assert (p.w13t is None) == (packs and pack is None)
        held[pack] = _held_bytes(p, (w13, w2))
    if packs:  # bf16 with FC1 in fp32: 2 x 3 against 4 x 2 bytes per FC2 weight
        assert held[None] <= (0.25 if "fp8_fp8" in kernel else 0.75) * held[False], held
    else:
        assert held[None] == held[False]


@needs_kpack
@pytest.mark.parametrize(
    ("fmt", "h", "inter"),
    [("bf16", 264, 76), ("bf16", 2048, 768), ("mxfp8", 256, 160), ("fp8", 256, 384)],
)
def test_mm_blocks_on_the_packed_copy_give_the_unpacked_bits(fmt: str, h: int, inter: int) -> None:
    """Every expert through the `mm` blocks (`gemm_rows=0`; ragged: empty, 1, 2, 17, 300
    rows): read from the packed copy alone (`_mm_k16`, partial 16-column blocks where N is
    not a multiple of 16), the same bits as from the unpacked weights."""
    e = 5
    w13, w2 = _weights(e, h, inter, 7)
    cls: Any = get_kernel(f"any_{fmt}_{fmt}_bf16_torch")
    recipe: Any = Bf16Recipe() if fmt == "bf16" else cls.make_recipe(cls.config_cls())
    plain = recipe.prepare(MoEWeightPack(w13, w2))
    packed = experts.prepack(plain)
    assert packed.w13t is None and packed.kpack13 is not None
    g = torch.Generator().manual_seed(8)
    counts = [0, 1, 2, 17, 300]
    cdt = plain.compute_dtype
    rows = torch.randn(320, h, generator=g).to(cdt)
    src_row = torch.randint(0, 320, (sum(counts),), generator=g)
    requant = None if recipe.requantize_is_rounding else recipe.requantize_into
    outs = []
    for weights in (plain, packed):
        y = torch.empty(sum(counts), h, dtype=torch.bfloat16)
        experts.run_experts(
            rows, src_row, counts, weights, requant, None, y, Workspace(), gemm_rows=0
        )
        outs.append(y)
    assert outs[0].abs().sum() > 0
    assert torch.equal(outs[0], outs[1])


@needs_kpack
def test_bf16_with_fc1_kept_in_fp32_runs_on_the_packed_copy() -> None:
    """`fc1_output_high_precision` (fp32 w13t, the bf16 values): the packed copy holds them,
    FC1 writes fp32, and the forward is within the oracle with the same option."""
    out, (prepared, ref) = _forward(
        True, h=512, inter=256, e=16, t=16, fc1_output_high_precision=True
    )
    assert prepared.kpack13 is not None
    report = compare_to_oracle(out, ref)
    assert report.ok, report


@needs_kpack
def test_fp8_codes_that_do_not_pack_are_refused_with_the_reason() -> None:
    """Weights so large that a block scale reaches 256 (the packed decode's limit): True is
    refused saying so, None keeps the unpacked weights."""
    cls: Any = get_kernel("any_fp8_fp8_bf16_torch")
    w13, w2 = _weights(2, 128, 128, 0)
    w13[1, 3, 5] = 200000.0
    for pack in (True, None):
        make = functools.partial(
            cls,
            config=cls.config_cls(cpu_prepacked_weights=pack),
            fleet=FleetParams(2, 8, 128),
            runtime=SimpleNamespace(world_size=1, rank=0, device=_CPU),
            weights=MoEWeightPack(w13, w2),
        )
        if pack:
            with pytest.raises(
                MoeEpUsageError,
                match=r"cpu_prepacked_weights=True cannot apply here: the FC1 weights' values are "
                r"not exact in bf16 \(the packed values' width\) and their codes do not pack: a "
                r"weight scale is not finite or not below 256 in magnitude; leave it None or False",
            ):
                make()
        else:
            assert make().prepared.kpack13 is None


@needs_kpack
def test_k_order_packing_is_refused_with_no_expert_gemm() -> None:
    with pytest.raises(
        MoeEpUsageError,
        match=r"cpu_prepacked_weights=True packs the weights for the CPU expert GEMM on this "
        r"CPU \(torch has no oneDNN bf16 GEMMs here\), which expert_gemm_rows=0 never runs",
    ):
        _kernel("any_bf16_bf16_bf16_torch", _CPU, expert_gemm_rows=0)


@pytest.mark.parametrize("bad", [1, "yes", 0.0])
def test_prepacking_field_refuses_non_bools(bad: object) -> None:
    with pytest.raises(MoeEpUsageError, match=r"cpu_prepacked_weights must be None or a bool, got"):
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(cpu_prepacked_weights=bad)  # type: ignore[arg-type]


def test_prepacking_is_refused_with_capture_safe() -> None:
    with pytest.raises(MoeEpUsageError, match=r"cpu_prepacked_weights=True is not read by the"):
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(cpu_prepacked_weights=True, capture_safe=True)


@pytest.mark.parametrize("n", [5, 16, 37])
def test_unpacked_gives_the_packed_bf16_weights_back(n: int) -> None:
    w = torch.randn(3, n, 40).bfloat16()
    kp = cpu_fused.pack_k16(w)
    back = kp.unpacked()
    assert back.shape == w.shape and back.is_contiguous()
    assert torch.equal(back.view(torch.int16), w.view(torch.int16))
    assert torch.equal(cpu_fused.pack_k16(back).codes, kp.codes)


@needs_kpack
def test_unpacked_refuses_codes() -> None:
    codes = torch.randint(0, 0x7E, (2, 32, 64), dtype=torch.uint8)
    stored = cpu_fused.StoredWeight(codes, "e4m3", torch.ones(2, 32, 2), "fp32", 32)
    with pytest.raises(ValueError, match="e4m3 codes, not bf16 values"):
        cpu_fused.pack_k16_codes(stored).unpacked()


def _caller_pack_freed(pack: bool | None, **fields: Any) -> tuple[bool, Any]:
    """(whether the caller's w13 is freed once the caller drops it, the layer)."""
    import gc
    import weakref

    w13, w2 = _weights(4, 128, 64, seed=3)
    alive = weakref.ref(w13)
    config = Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(cpu_prepacked_weights=pack, **fields)
    layer = MoEEpLayer(
        BootstrapConfig(1, 0), FleetParams(4, 16, 128), MoEWeightPack(w13, w2), config
    )
    del w13, w2
    gc.collect()
    return alive() is None, layer


@needs_kpack
@pytest.mark.parametrize("fields", [{}, {"fc1_output_high_precision": True}])
def test_a_k_order_packed_bf16_layer_holds_no_reference_to_the_callers_weights(
    fields: dict[str, Any],
) -> None:
    """The packed copy replaces the weights, so the layer drops the caller's pack (freed
    once the caller drops it) and rebuilds it bit for bit when it needs it."""
    w13, w2 = _weights(4, 128, 64, seed=3)
    freed, layer = _caller_pack_freed(True, **fields)
    try:
        assert freed and layer._weights is None
        back = layer._weight_pack()
        assert torch.equal(back.w13.view(torch.int16), w13.view(torch.int16))
        assert torch.equal(back.w2.view(torch.int16), w2.view(torch.int16))
    finally:
        layer.destroy()


def test_an_unpacked_bf16_layer_keeps_the_callers_weights() -> None:
    """The default reads the caller's tensors (views, no copy): the layer keeps the pack."""
    freed, layer = _caller_pack_freed(False)
    try:
        assert not freed and layer._weights is not None
        assert not layer._kernel.rebuilds_weights
    finally:
        layer.destroy()

"""Construction and forward validation, lifecycle, staging (one rank, in this process)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
from moe_ep.backends.portable import (
    Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig,
    Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig,
)
from moe_ep.errors import MoeEpUsageError
from moe_ep.oracle import compare_to_oracle, oracle_forward
from moe_ep.spawn import free_port

E, H, I, MAX_T = 4, 128, 128, 8  # noqa: E741 - I is the glossary name
BF16 = "any_bf16_bf16_bf16_torch"


def _boot(world_size: int = 1, rank: int = 0) -> BootstrapConfig:
    return BootstrapConfig(world_size, rank, init_method=f"tcp://127.0.0.1:{free_port()}")


def _weights(e: int = E, h: int = H, i: int = I) -> MoEWeightPack:
    g = torch.Generator().manual_seed(0)
    return MoEWeightPack(
        (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16(),
        (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16(),
    )


def _inputs(n: int = 5, k: int = 2) -> MoEEpTensors:
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    return MoEEpTensors(
        torch.randn(n, H, generator=g).bfloat16(), ids, torch.rand(n, k, generator=g)
    )


@pytest.fixture(scope="module")
def layer() -> Iterator[MoEEpLayer]:
    built = MoEEpLayer(_boot(), FleetParams(E, MAX_T, H), _weights(), BF16)
    yield built
    built.destroy()


# -- construction: every check runs before any rendezvous --------------------------------
# A world size of 4 with no MASTER_ADDR / init_method would fail or wait in the rendezvous;
# getting the validation error proves it is raised first.
def _build(weights: MoEWeightPack, backend: object = BF16, e: int = E, ws: int = 4) -> None:
    MoEEpLayer(BootstrapConfig(ws, 1), FleetParams(e, MAX_T, H), weights, backend)  # type: ignore[arg-type]


def test_experts_must_divide_world_size() -> None:
    with pytest.raises(MoeEpUsageError, match="num_experts must be divisible by world_size"):
        _build(_weights(e=1), e=6)


def test_weight_shapes_are_checked() -> None:
    w = _weights(e=1)
    with pytest.raises(MoeEpUsageError, match=r"w13 must be \[E_local, 2I, H\]"):
        _build(MoEWeightPack(w.w13[:, :-2], w.w2))
    with pytest.raises(MoeEpUsageError, match="hidden_size = 128"):
        _build(MoEWeightPack(w.w13, torch.zeros(1, H + 1, I, dtype=torch.bfloat16)))
    with pytest.raises(MoeEpUsageError, match="E_local = num_experts / world_size = 4 / 4 = 1"):
        _build(_weights(e=2))
    with pytest.raises(MoeEpUsageError, match="3-D"):
        MoEWeightPack(w.w13[0], w.w2)


def test_weight_dtypes_and_values_are_checked() -> None:
    w = _weights(e=1)
    with pytest.raises(MoeEpUsageError, match="w13 dtype must be one of"):
        _build(MoEWeightPack(w.w13.to(torch.int32), w.w2))
    with pytest.raises(MoeEpUsageError, match="must share a dtype"):
        _build(MoEWeightPack(w.w13.float(), w.w2))
    bad = w.w2.clone()
    bad[0, 3, 4] = float("nan")
    with pytest.raises(MoeEpUsageError, match="w2 has non-finite values"):
        _build(MoEWeightPack(w.w13, bad))


def test_scale_planes_both_or_neither() -> None:
    w = _weights(e=1)
    with pytest.raises(MoeEpUsageError, match="only w13_scale was given"):
        MoEWeightPack(w.w13, w.w2, w13_scale=torch.ones(1))
    with pytest.raises(MoeEpUsageError, match="only w2_scale was given"):
        MoEWeightPack(w.w13, w.w2, w2_scale=torch.ones(1))
    with pytest.raises(MoeEpUsageError, match="takes bf16 / fp32 weights only"):
        _build(MoEWeightPack(w.w13, w.w2, w13_scale=torch.ones(1), w2_scale=torch.ones(1)))


def test_packed_fp4_halves_are_checked() -> None:
    e = 1
    w13 = torch.zeros(e, 2 * I, H // 2, dtype=torch.uint8)
    w2 = torch.zeros(e, H, I // 2, dtype=torch.uint8)
    s13 = torch.ones(e, 2 * I, H // 16).to(torch.float8_e4m3fn)
    s2 = torch.ones(e, H, I // 16).to(torch.float8_e4m3fn)
    nvfp4 = "any_nvfp4_nvfp4_bf16_torch"
    with pytest.raises(MoeEpUsageError, match=r"w13 must be \[E_local, 2I, H/2\]"):
        _build(MoEWeightPack(torch.zeros(e, 2 * I, H, dtype=torch.uint8), w2, s13, s2), nvfp4)
    with pytest.raises(MoeEpUsageError, match="w2_scale must be e4m3"):
        _build(MoEWeightPack(w13, w2, s13, s2[:, :, :-1]), nvfp4)


@pytest.mark.parametrize("backend", [BF16, "any_nvfp4_nvfp4_bf16_torch"])
def test_weights_are_validated_once_per_construction(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """One generic pack check and one isfinite pass over each weight per construction (the
    layer's, before the rendezvous; the kernel does not repeat it)."""
    import moe_ep.backends.portable.kernel as portable

    w = _weights()
    passes: list[tuple[int, ...]] = []
    checks: list[object] = []
    real_isfinite, real_check = torch.isfinite, portable.check_weight_pack

    def isfinite(t: torch.Tensor) -> torch.Tensor:
        if t.shape in (w.w13.shape, w.w2.shape):
            passes.append(tuple(t.shape))
        return real_isfinite(t)

    def check(*args: object, **kwargs: object) -> object:
        checks.append(args[0])
        return real_check(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "isfinite", isfinite)
    monkeypatch.setattr(portable, "check_weight_pack", check)
    built = MoEEpLayer(_boot(), FleetParams(E, MAX_T, H), w, backend)
    try:
        assert checks == [w]
        assert sorted(passes) == sorted([tuple(w.w13.shape), tuple(w.w2.shape)])
        # a kernel built directly (no layer in front of it) still checks its weights
        bad = MoEWeightPack(w.w13, w.w2[:, :, :-16])
        with pytest.raises(MoeEpUsageError, match=r"w13 must be \[E_local, 2I, H\]"):
            type(built._kernel)(
                config=built.config, fleet=built.fleet, runtime=built._runtime, weights=bad
            )
    finally:
        built.destroy()


def test_backend_argument() -> None:
    w = _weights(e=1)
    with pytest.raises(MoeEpUsageError, match="backend must be a kernel name"):
        _build(w, backend=3)
    with pytest.raises(KeyError, match="unknown kernel 'nope'"):
        _build(w, backend="nope")
    with pytest.raises(MoeEpUsageError, match="multiples of 128"):
        _build(MoEWeightPack(w.w13[:, :128], w.w2[:, :, :64]), "any_fp8_fp8_bf16_torch")


def test_configs_are_frozen_keyword_only_and_validated() -> None:
    with pytest.raises(MoeEpUsageError, match="swiglu_clamp must be a finite float > 0"):
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(swiglu_clamp=-1.0)
    with pytest.raises(MoeEpUsageError, match="dedup must be a bool"):
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(dedup="yes")  # type: ignore[arg-type]
    with pytest.raises(MoeEpUsageError, match="act_global_scale"):
        Any_Nvfp4_Nvfp4_Bf16_Torch_MegaMoeConfig(act_global_scale=float("inf"))
    with pytest.raises(TypeError):
        Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(1.0)  # type: ignore[misc]
    cfg = Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(dedup=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dedup = True  # type: ignore[misc]
    assert all(f.kw_only for f in dataclasses.fields(cfg))
    assert cfg.kernel_name == BF16


def test_fleet_params_are_validated() -> None:
    with pytest.raises(MoeEpUsageError, match="num_experts must be an int >= 1"):
        FleetParams(0, 8, 128)
    with pytest.raises(MoeEpUsageError, match="hidden_size must be an int >= 1"):
        FleetParams(8, 8, 1.5)  # type: ignore[arg-type]


# -- forward --------------------------------------------------------------------------------
def _replace(t: MoEEpTensors, **kw: object) -> MoEEpTensors:
    return dataclasses.replace(t, **kw)  # type: ignore[arg-type]


def test_ids_out_of_range_message(layer: MoEEpLayer) -> None:
    t = _inputs()
    ids = t.topk_ids.clone()
    ids[3, 1] = 19
    with pytest.raises(
        MoeEpUsageError, match=r"^topk_ids has values outside \[-1, 4\): max=19 at row 3$"
    ):
        layer(_replace(t, topk_ids=ids))
    ids = t.topk_ids.clone()
    ids[2, 0] = -2
    with pytest.raises(MoeEpUsageError, match=r"min=-2 at row 2"):
        layer(_replace(t, topk_ids=ids))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("topk_ids", lambda t: t.topk_ids.float(), "topk_ids must be int32 or int64"),
        ("topk_ids", lambda t: t.topk_ids[:, :1].t(), r"topk_ids must be \[n, k\]"),
        ("topk_weights", lambda t: t.topk_weights.double(), "must be float32, or bfloat16 / fl"),
        ("topk_weights", lambda t: t.topk_weights.to(torch.int32), "got torch.int32"),
        ("topk_weights", lambda t: t.topk_weights[:, :1], "topk_weights must have topk_ids' shape"),
        ("hidden_states", lambda t: t.hidden_states.float(), "hidden_states must be bfloat16"),
        ("hidden_states", lambda t: t.hidden_states[:, :64], r"hidden_states must be \[n, H\]"),
        ("hidden_states", lambda t: t.hidden_states.to("meta"), "must be on the layer's device"),
        ("output", lambda t: torch.empty(4, H, dtype=torch.bfloat16), r"output must be \[n, H\]"),
        ("output", lambda t: torch.empty(5, H), "output must be"),
    ],
)
def test_forward_rejects_bad_tensors(
    layer: MoEEpLayer, field: str, value: object, message: str
) -> None:
    t = _inputs()
    with pytest.raises(MoeEpUsageError, match=message):
        layer(_replace(t, **{field: value(t)}))  # type: ignore[operator]


def test_non_finite_weights_and_too_many_tokens(layer: MoEEpLayer) -> None:
    t = _inputs()
    w = t.topk_weights.clone()
    w[4, 1] = float("inf")
    with pytest.raises(MoeEpUsageError, match=r"topk_weights must be finite: .* at row 4"):
        layer(_replace(t, topk_weights=w))
    big = _inputs(n=MAX_T + 1)
    with pytest.raises(MoeEpUsageError, match="n = 9 rows, more than max_tokens_per_rank = 8"):
        layer(big)
    with pytest.raises(MoeEpUsageError, match="tensors must be a MoEEpTensors"):
        layer((t.hidden_states, t.topk_ids, t.topk_weights))  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
def test_every_non_finite_top_k_weight_is_refused(
    layer: MoEEpLayer, dtype: torch.dtype, bad: float
) -> None:
    t = _inputs()
    w = t.topk_weights.to(dtype)
    w[3, 0] = bad  # one value among finite ones: a min / max reading must still see it
    with pytest.raises(MoeEpUsageError, match=r"topk_weights must be finite: .* at row 3"):
        layer(_replace(t, topk_weights=w))


@pytest.mark.parametrize(("value", "which"), [(-2, "min=-2"), (E, f"max={E}")])
def test_expert_ids_outside_the_range_are_refused(
    layer: MoEEpLayer, value: int, which: str
) -> None:
    t = _inputs()
    ids = t.topk_ids.clone()
    ids[3, 1] = value
    with pytest.raises(MoeEpUsageError, match=rf"outside \[-1, {E}\): {which} at row 3"):
        layer(_replace(t, topk_ids=ids))
    ids[3, 1] = -1  # -1 (padded) and E - 1 are in range
    ids[2, 0] = E - 1
    layer(_replace(t, topk_ids=ids))


def test_forward_matches_oracle_output_honoured_and_staging(layer: MoEEpLayer) -> None:
    t = _inputs()
    ids = t.topk_ids.clone()
    ids[0] = torch.tensor([2, 2])  # duplicate expert: both slots are summed
    ids[1, 1] = -1
    t = _replace(t, topk_ids=ids)
    w = _weights()
    ref = oracle_forward(t.hidden_states, ids, t.topk_weights, w.w13, w.w2)
    out = layer(t)
    assert compare_to_oracle(out, ref).ok
    given = torch.full((5, H), 7.0, dtype=torch.bfloat16)
    got = layer(_replace(t, output=given))
    assert got is given and torch.equal(given, out)
    staged = layer.stage_inputs(t)
    assert staged.output.shape == (5, H)
    assert torch.equal(layer.compute_staged(staged), out)
    with pytest.raises(MoeEpUsageError, match="already computed"):
        layer.compute_staged(staged)
    with pytest.raises(MoeEpUsageError, match="must come from this layer"):
        layer.compute_staged(object())  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_topk_weights_are_upcast_exactly(
    layer: MoEEpLayer, dtype: torch.dtype
) -> None:
    """What Hugging Face routers return (bf16 / fp16 softmax outputs) is accepted; the
    forward equals the fp32 forward of the same values, bit for bit."""
    t = _inputs()
    half = (t.topk_weights * 3 - 1).to(dtype)  # negative and > 1 values too
    assert not torch.equal(half.float(), t.topk_weights)
    got = layer(_replace(t, topk_weights=half))
    want = layer(_replace(t, topk_weights=half.float()))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(got, layer(t))  # the weights really matter here
    bad = half.clone()
    bad[2, 0] = float("nan")
    with pytest.raises(MoeEpUsageError, match=r"topk_weights must be finite: .* at row 2"):
        layer(_replace(t, topk_weights=bad))


def test_staged_forward_of_another_layer_is_refused(layer: MoEEpLayer) -> None:
    other = MoEEpLayer(_boot(), FleetParams(E, MAX_T, H), _weights(), BF16)
    try:
        staged = other.stage_inputs(_inputs())
        with pytest.raises(MoeEpUsageError, match="staged must come from this layer"):
            layer.compute_staged(staged)
        assert not staged.used
        assert torch.equal(other.compute_staged(staged), layer(_inputs()))
    finally:
        other.destroy()


def test_stream_is_refused_on_a_cpu_rank() -> None:
    # world size 4 with no rendezvous: the error must come before any collective
    with pytest.raises(
        MoeEpUsageError, match=r"^BootstrapConfig.stream=7 is a CUDA stream handle, .* on CPU"
    ):
        MoEEpLayer(BootstrapConfig(4, 1, stream=7), FleetParams(E, MAX_T, H), _weights(e=1), BF16)


def test_empty_batch_and_all_padded(layer: MoEEpLayer) -> None:
    t = _inputs()
    empty = layer(MoEEpTensors(t.hidden_states[:0], t.topk_ids[:0], t.topk_weights[:0]))
    assert empty.shape == (0, H) and empty.dtype == torch.bfloat16
    padded = layer(_replace(t, topk_ids=torch.full_like(t.topk_ids, -1)))
    assert torch.equal(padded, torch.zeros_like(padded))


def test_destroy_is_idempotent_and_use_after_destroy_raises() -> None:
    built = MoEEpLayer(
        _boot(), FleetParams(E, MAX_T, H), _weights(), Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig()
    )
    t = _inputs()
    built.warmup()
    built(t)
    built.destroy()
    built.destroy()
    assert built.destroyed
    for call in (lambda: built(t), lambda: built.stage_inputs(t), built.warmup):
        with pytest.raises(MoeEpUsageError, match="destroyed"):
            call()


def test_weight_pack_to_moves_every_tensor_and_keeps_none() -> None:
    w13, w2 = torch.ones(2, 8, 4), torch.ones(2, 4, 4)
    s13, s2 = torch.ones(2, 1, 1), torch.ones(2, 1, 1)
    plain = MoEWeightPack(w13, w2).to("cpu")
    assert plain.w13 is w13 and plain.w2 is w2  # already there: not copied
    assert plain.w13_scale is None and plain.w2_global_scale is None
    pack = MoEWeightPack(w13.bfloat16(), w2.bfloat16(), s13, s2).to(torch.device("meta"))
    for name in ("w13", "w2", "w13_scale", "w2_scale"):
        assert getattr(pack, name).device.type == "meta", name
    assert pack.prequantized and pack.w13_global_scale is None


def test_one_tokens_overflow_stays_in_that_token(layer: MoEEpLayer) -> None:
    """Token 0 (finite but huge) overflows its expert's output to inf / NaN; it is the first
    pair of expert 0, i.e. row 0 of the expert outputs. Token 1 has a padded slot: its output
    must still be its one valid slot's, finite (a padded slot reads no row)."""
    t = _inputs(n=2, k=2)
    x = t.hidden_states.clone()
    x[0] = 3e38
    ids = torch.tensor([[0, 1], [2, -1]])
    out = layer(MoEEpTensors(x, ids, t.topk_weights))
    assert not bool(torch.isfinite(out[0]).all())  # the overflow is real
    alone = layer(MoEEpTensors(x[1:], ids[1:], t.topk_weights[1:]))
    assert bool(torch.isfinite(out[1]).all())
    assert torch.equal(out[1], alone[0])

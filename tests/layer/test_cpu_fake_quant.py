"""The fused CPU requantization of the FC2 input (`cpu_fused.fake_quant`) against the
recipes' eager `requantize` (moe_ep.quant's quantize / dequantize pair, itself tested
against the formats' definitions): the same bits everywhere, NaN exactly where it gives NaN.

The inputs aim at every rule: block amaxes across fp32's range (tiny, subnormal, near
FLT_MAX), all-zero blocks of either sign, NaN and +-inf blocks, elements at and around
each rounding boundary (found on the eager code), scales that round to zero or clamp at
448, and nvfp4's global scale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, quant
from moe_ep.backends.portable import cpu_fused, experts, recipes
from moe_ep.backends.portable.comm import Workspace
from moe_ep.spawn import free_port
from moe_ep.types import MoEWeightPack

needs_library = pytest.mark.skipif(
    cpu_fused.library() is None, reason="the fused CPU library does not build here"
)

RECIPES: dict[str, recipes.Recipe] = {
    "mxfp8": recipes.Mxfp8Recipe(),
    "mxfp8_mxfp4": recipes.Mxfp8Mxfp4Recipe(),
    "nvfp4": recipes.Nvfp4Recipe(),
    "nvfp4 global scale 37.3": recipes.Nvfp4Recipe(hidden_global_scale=37.3),
    "nvfp4 global scale 1e-3": recipes.Nvfp4Recipe(hidden_global_scale=1e-3),
    "nvfp4 global scale 1e30": recipes.Nvfp4Recipe(hidden_global_scale=1e30),
    "nvfp4 global scale 1e-37": recipes.Nvfp4Recipe(hidden_global_scale=1e-37),
    "fp8": recipes.Fp8BlockRecipe(),
    "fp8 block 64": recipes.Fp8BlockRecipe(fc2_act_block=64),
    "fp8_fp4": recipes.Fp8Fp4Recipe(),
    "fp8_mxfp4": recipes.Fp8Mxfp4Recipe(),
    "fp8_nvfp4": recipes.Fp8Nvfp4Recipe(),
}


def _hard_rows(cols: int, seed: int) -> torch.Tensor:
    """Rows of fp32 with blocks (of every size that divides 128) that each stress a rule."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for log_scale in (-45.0, -40.0, -20.0, -3.0, 0.0, 2.0, 9.0, 30.0, 37.0):
        rows.append(torch.randn(cols, generator=g) * 2.0**log_scale)
    # low-entropy values: many land on the ties of e4m3 and e2m1 after scaling
    for den in (4.0, 16.0, 64.0, 512.0):
        rows.append(torch.randint(-3000, 3000, (cols,), generator=g).float() / den)
    row = torch.randn(cols, generator=g)
    row[:16] = 0.0
    row[16:32] = -0.0
    row[32:48] = torch.tensor([0.0, -0.0] * 8)
    row[64] = float("nan")
    row[96] = float("inf")
    row[100] = float("-inf")
    rows.append(row)
    rows.append(torch.full((cols,), 3.4e38) * torch.randn(cols, generator=g).sign())
    rows.append(torch.randn(cols, generator=g) * 1e-39)  # fp32 subnormals
    rows.append(torch.where(torch.rand(cols, generator=g) < 0.9, 0.0, 1e-42))
    x = torch.stack(rows)
    return x[torch.randperm(x.shape[0], generator=g)]


# block amaxes: every 9th binade of fp32 (scales of every size, incl. those nvfp4's global
# scales 1e30 and 1e-37 leave unclamped), the ceil rule's boundaries 448 x 2^k
BOUNDARY_AMAXES = [1.37 * 2.0**k for k in range(-125, 127, 9)]
BOUNDARY_AMAXES += [448.0 * 2.0**k for k in (-20, 0, 9)]
BOUNDARY_AMAXES += [1e38, 3e38]  # nvfp4 with global scale 1e-37: acc * 2^-6 an fp32 subnormal
ULPS = 3


def _changes(
    f: Callable[[torch.Tensor], torch.Tensor], lo: float, hi: float, step: int
) -> torch.Tensor:
    """The fp32 bit patterns in (lo, hi] (positive) at which f, a function of fp32 values
    giving one output row per value, starts a new step: on a grid `step` patterns apart
    (2^23 a binade), then by bisection (bit patterns order positive floats)."""

    def ys(bits: torch.Tensor) -> torch.Tensor:
        return f(bits.view(torch.float32))

    a = torch.tensor([lo, hi], dtype=torch.float32).view(torch.int32)
    grid = torch.arange(int(a[0]), int(a[1]), step, dtype=torch.int32)
    out = ys(grid)
    change = (out[1:] != out[:-1]).any(dim=1)
    lo_b, hi_b = grid[:-1][change], grid[1:][change]
    while bool((hi_b - lo_b > 1).any()):
        mid = lo_b + (hi_b - lo_b) // 2
        same = (ys(mid) == ys(lo_b)).all(dim=1)
        lo_b, hi_b = torch.where(same, mid, lo_b), torch.where(same, hi_b, mid)
    return hi_b


def _led_blocks(recipe: recipes.Recipe, lead: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Blocks of the recipe's size: lead[i], then rest[i] (a value or a row), zeros after."""
    assert recipe.fake_quant is not None
    blocks = torch.zeros(lead.numel(), recipe.fake_quant.block)
    blocks[:, 0] = lead
    blocks[:, 1 : 1 + (rest.shape[1] if rest.dim() == 2 else 1)] = rest.view(lead.numel(), -1)
    return blocks


def _around(bits: torch.Tensor) -> torch.Tensor:
    """The fp32 values within ULPS ulps of bit patterns `bits`."""
    near = bits + torch.arange(-ULPS, ULPS + 1, dtype=torch.int32)[:, None]
    return near.flatten().view(torch.float32)


@functools.cache
def _boundary_rows(name: str, cols: int) -> torch.Tensor:
    """Blocks (the recipe's size) that put values within ULPS ulps of each rounding
    boundary of the eager requantize of RECIPES[name]: (1) element boundaries, x in
    [amax * 2^-20, amax) in a block [amax, x]; (2) scale boundaries, amax in a block
    [amax, 0.37 amax] (the scale's rounding moves the element's output). Signs alternate.
    A grid of 128 (x) or 64 (amax) points a binade finds every step of e4m3 (8 a binade)
    and e2m1."""
    recipe = RECIPES[name]
    assert recipe.fake_quant is not None
    blocks = []
    for amax in BOUNDARY_AMAXES:

        def element(x: torch.Tensor, amax: float = amax) -> torch.Tensor:
            return recipe.requantize(_led_blocks(recipe, torch.full_like(x, amax), x))[:, 1:2]

        vals = _around(_changes(element, amax * 2.0**-20, amax, 1 << 16))
        vals = vals[(vals > 0) & (vals < amax)]
        if vals.numel():
            blocks.append(_led_blocks(recipe, torch.full_like(vals, amax), vals))

    def scale(a: torch.Tensor) -> torch.Tensor:
        return recipe.requantize(_led_blocks(recipe, a, a * 0.37))[:, :2]

    leads = _around(_changes(scale, 2.0**-120, 2.0**120, 1 << 17))
    leads = leads[leads > 0]
    blocks.append(_led_blocks(recipe, leads, leads * 0.37))
    flat = torch.cat(blocks).flatten()
    flat = torch.cat([flat, torch.zeros(-flat.numel() % cols)])
    rows = flat.view(-1, cols)
    rows[:, 1::3] *= -1.0
    return rows


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bit-identical where not NaN (signed zeros included), NaN at the same places."""
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        return False
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    return torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


@needs_library
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(RECIPES))
def test_fused_requantize_gives_the_eager_bits(name: str, out_dtype: torch.dtype) -> None:
    recipe = RECIPES[name]
    spec = recipe.fake_quant
    assert spec is not None
    rows = torch.cat([_hard_rows(256, 0), _boundary_rows(name, 256)])
    wide = torch.zeros(rows.shape[0], 256 + 64)
    x = wide[:, :256]  # a view with a row stride, as the SwiGLU output's g half
    x.copy_(rows)
    want = recipe.requantize(x.clone()).to(out_dtype)
    got = torch.full_like(want, 7.0)
    assert cpu_fused.fake_quant(x, got, spec)
    assert _same(got, want), name
    assert _same(x, rows)  # the input is left as it was


@needs_library
@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "fp8", "fp8_fp4", "fp8_mxfp4"])
def test_fused_requantize_on_random_activations(name: str) -> None:
    """SwiGLU-like activations (heavy tails) at several magnitudes, many rows."""
    recipe = RECIPES[name]
    assert recipe.fake_quant is not None
    g = torch.Generator().manual_seed(1)
    for scale in (1e-6, 1.0, 1e4):
        x = torch.randn(300, 512, generator=g) ** 3 * scale
        want = recipe.requantize(x.clone()).bfloat16()
        got = torch.empty_like(want)
        assert cpu_fused.fake_quant(x, got, recipe.fake_quant)
        assert _same(got, want), (name, scale)


@needs_library
def test_requantize_into_uses_the_fused_pass_and_falls_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recipe = recipes.Nvfp4Recipe(hidden_global_scale=3.0)
    x = torch.randn(8, 64)
    want = recipe.requantize(x.clone()).bfloat16()
    calls: list[cpu_fused.FakeQuant] = []
    real = cpu_fused.fake_quant

    def counted(x: torch.Tensor, out: torch.Tensor, spec: cpu_fused.FakeQuant) -> bool:
        calls.append(spec)
        return real(x, out, spec)

    monkeypatch.setattr(cpu_fused, "fake_quant", counted)
    out = torch.empty_like(want)
    recipe.requantize_into(x, out)
    assert calls == [cpu_fused.FakeQuant("nvfp4", 16, 3.0)] and torch.equal(out, want)
    monkeypatch.setattr(cpu_fused, "library", lambda: None)  # no library: the eager ops
    out.fill_(0.0)
    recipe.requantize_into(x, out)
    assert torch.equal(out, want)


def test_fake_quant_refuses_what_it_cannot_do() -> None:
    spec = cpu_fused.FakeQuant("mxfp8", 32)
    x = torch.randn(4, 64)
    assert not cpu_fused.fake_quant(x.bfloat16(), torch.empty(4, 64), spec)  # x not fp32
    assert not cpu_fused.fake_quant(x, torch.empty(4, 64, dtype=torch.float16), spec)
    assert not cpu_fused.fake_quant(x[:, :48], torch.empty(4, 48), spec)  # 48 % 32
    assert not cpu_fused.fake_quant(x.t(), torch.empty(64, 4), spec)  # a column stride
    assert not cpu_fused.fake_quant(x, torch.empty(4, 32), spec)  # shapes differ
    nvfp4 = cpu_fused.FakeQuant("nvfp4", 16, 0.0)
    assert not cpu_fused.fake_quant(x, torch.empty(4, 64), nvfp4)  # the eager code raises


def test_every_recipe_with_a_requantization_has_a_fused_one() -> None:
    """Only bf16 (whose requantization is the rounding itself) goes without."""
    for name, cls in vars(recipes).items():
        if isinstance(cls, type) and issubclass(cls, recipes.Recipe) and not name.startswith("_"):
            if cls is recipes.Recipe:
                continue
            recipe = cls()
            assert (recipe.fake_quant is None) == recipe.requantize_is_rounding, name


@needs_library
@pytest.mark.parametrize(
    "name", ["mxfp8", "mxfp8_mxfp4", "nvfp4 global scale 37.3", "fp8", "fp8_fp4", "fp8_mxfp4"]
)
def test_experts_give_the_same_bits_with_the_fused_requantize(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """run_experts (FC1, SwiGLU, the requantization, FC2) on ragged experts: the fused pass
    (it must run) and the eager requantize give the same output bits."""
    recipe = RECIPES[name]
    g = torch.Generator().manual_seed(3)
    hidden, inter, counts = 256, 128, [5, 0, 17]
    e = len(counts)
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, generator=g) / inter**0.5
    pw = recipe.prepare(MoEWeightPack(w13, w2))
    rows = recipe.unpack(recipe.pack(torch.randn(30, hidden, generator=g) * 4), hidden)
    src_row = torch.randint(0, 30, (sum(counts),), generator=g)
    fused: list[bool] = []
    real = cpu_fused.fake_quant

    def spy(x: torch.Tensor, out: torch.Tensor, spec: cpu_fused.FakeQuant) -> bool:
        fused.append(real(x, out, spec))
        return fused[-1]

    monkeypatch.setattr(cpu_fused, "fake_quant", spy)

    def eager(h: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(recipe.requantize(h))

    ys = []
    for requantize in (recipe.requantize_into, eager):
        y = torch.empty(sum(counts), hidden, dtype=torch.bfloat16)
        experts.run_experts(rows, src_row, counts, pw, requantize, None, y, Workspace())
        ys.append(y)
    assert fused and all(fused)
    assert torch.equal(ys[0], ys[1])


DISPATCH: dict[str, recipes.Recipe] = {
    "mxfp8": recipes.Mxfp8Recipe(),
    "nvfp4": recipes.Nvfp4Recipe(),
    "nvfp4 act global scale 37.3": recipes.Nvfp4Recipe(act_global_scale=37.3),
    "nvfp4 act global scale 1e-3": recipes.Nvfp4Recipe(act_global_scale=1e-3),
    "fp8": recipes.Fp8BlockRecipe(),
    "fp8_fp4": recipes.Fp8Fp4Recipe(),
}
"""The recipes whose FC1-input quantization has a fused pass (`Recipe.dispatch_fake_quant`)."""


@needs_library
@pytest.mark.parametrize("name", list(DISPATCH))
def test_pack_unpack_in_one_pass_gives_the_eager_bits(name: str) -> None:
    """`Recipe.pack_unpack` (the rows a group of one rank keeps) equals `unpack(pack(x))`
    bit for bit on rows that stress every rule; a pass with the block or the nvfp4 global
    scale doubled does not (the wiring is what this checks)."""
    recipe = DISPATCH[name]
    spec = recipe.dispatch_fake_quant
    assert spec is not None
    g = torch.Generator().manual_seed(7)
    # and rows whose neighbouring blocks are 2^12 apart: each block's own scale keeps the
    # small ones, a scale shared by two blocks flushes them
    steps = torch.randn(4, 256, generator=g) * 2.0 ** (
        -12.0 * (torch.arange(256) // spec.block % 2)
    )
    x = torch.cat([_hard_rows(256, seed=7), steps]).bfloat16()
    want = recipe.unpack(recipe.pack(x), 256)
    got = recipe.pack_unpack(x)
    assert got is not None and got.dtype == want.dtype
    assert _same(got, want)
    xf = x.float()  # rows already fp32: pass over a copy, never over the caller's rows
    assert _same(recipe.pack_unpack(xf), want) and _same(xf, x.float())
    faults = [spec._replace(block=2 * spec.block)]
    if spec.kind == "nvfp4":
        faults.append(spec._replace(norm_const=2 * spec.norm_const))
    for fault in faults:
        wrong = torch.empty_like(want)
        assert cpu_fused.fake_quant(x.float(), wrong, fault)
        assert not _same(wrong, want), fault


def test_recipes_without_a_fused_fc1_input_pass_say_so() -> None:
    """mxfp8_mxfp4's FC1 input has the normal-scales rule, the hybrids a per-token scale and
    bf16 no quantization: none of them has the pass, and pack_unpack leaves them eager."""
    x = torch.randn(4, 256).bfloat16()
    for recipe in (recipes.Mxfp8Mxfp4Recipe(), recipes.Fp8Mxfp4Recipe(), recipes.Bf16Recipe()):
        assert recipe.dispatch_fake_quant is None
        assert recipe.pack_unpack(x) is None


@needs_library
@pytest.mark.parametrize(
    "kernel",
    ["any_mxfp8_mxfp8_bf16_torch", "any_nvfp4_nvfp4_bf16_torch", "any_fp8_fp8_bf16_torch",
     "any_fp8_fp4_bf16_torch"],
)  # fmt: skip
def test_the_layer_of_one_rank_gives_the_same_bits_with_one_pass(
    monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """At world size 1 the dispatched rows never leave the rank: the layer quantizes and
    dequantizes them in one pass (it must run) and gives the bits of pack then unpack. fp8
    where its experts take the rows' codes (`Recipe.keeps_codes`: a CPU with AMX) packs
    them by the fused pass instead (it must run) and gives the bits of the eager pack."""
    g = torch.Generator().manual_seed(5)
    e, t, h, inter, k = 4, 24, 256, 128, 2
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    # groups of 16 columns 2^0 to 2^-12 apart: blocks of any size see their own amax
    group = 2.0 ** -torch.randint(0, 13, (h // 16,), generator=g).float()
    x = (torch.randn(t, h, generator=g) * group.repeat_interleave(16)).bfloat16()
    x[2, :40] = 0.0
    w = torch.rand(t, k, generator=g)
    boot = BootstrapConfig(1, 0, init_method=f"tcp://127.0.0.1:{free_port()}")
    layer = MoEEpLayer(boot, FleetParams(e, t, h), MoEWeightPack(w13, w2), kernel)
    codes = kernel == "any_fp8_fp8_bf16_torch" and cpu_fused.block_scaled_by_default()
    cls, name = (
        (recipes.Fp8BlockRecipe, "_pack_fused") if codes else (recipes.Recipe, "pack_unpack")
    )
    real = getattr(cls, name)
    ran: list[bool] = []

    def spy(self: recipes.Recipe, rows: torch.Tensor) -> torch.Tensor | None:
        out = real(self, rows)
        ran.append(out is not None)
        return out

    try:
        monkeypatch.setattr(cls, name, spy)
        fused = layer(MoEEpTensors(x, ids, w)).clone()
        monkeypatch.setattr(cls, name, lambda self, rows: None)
        eager = layer(MoEEpTensors(x, ids, w)).clone()
    finally:
        layer.destroy()
    assert ran and all(ran)
    assert torch.equal(fused, eager)


@needs_library
@pytest.mark.parametrize(
    ("recipe", "fmt"), [(recipes.Fp8BlockRecipe(), "fp32"), (recipes.Fp8Fp4Recipe(), "ue8m0")]
)
def test_the_fused_pack_gives_the_eager_bytes(recipe: recipes.Fp8BlockRecipe, fmt: str) -> None:
    """`pack` on CPU by the fused pass (`cpu_fused.quant_e4m3`, writing through the
    payload's strided views): the codes and scales of `quant.quantize_fp8_blockwise` byte
    for byte on finite rows with every rounding boundary; a row with NaN and inf unpacks
    to NaN where the eager bytes do, to the same values elsewhere."""
    x = _hard_rows(512, seed=12)
    for rows in (x[torch.isfinite(x).all(1)], x):
        got = recipe._pack_fused(rows)
        assert got is not None
        data, scales = quant.quantize_fp8_blockwise(
            rows, block=(1, recipe.act_block), scale_format=fmt, check_finite=False
        )
        want = torch.cat([data.view(torch.uint8), scales.view(torch.uint8)], dim=1)
        if bool(torch.isfinite(rows).all()):
            assert torch.equal(got, want)
            assert torch.equal(recipe.pack(rows), want)
        else:
            a, b = recipe.unpack(got, 512), recipe.unpack(want, 512)
            assert torch.equal(a.isnan(), b.isnan()) and bool(a.isnan().any())
            assert torch.equal(a.nan_to_num(), b.nan_to_num())


@needs_library
@pytest.mark.parametrize(
    "name", ["mxfp8", "nvfp4 global scale 37.3", "fp8", "fp8_fp4", "fp8_mxfp4"]
)
def test_fake_quant_in_place_gives_the_same_bits(name: str) -> None:
    """`out` may be `x` (what `Recipe.pack_unpack` does): the same bits as into another
    tensor."""
    spec = RECIPES[name].fake_quant
    assert spec is not None
    x = _hard_rows(256, seed=11)
    want = torch.empty_like(x)
    assert cpu_fused.fake_quant(x, want, spec)
    got = x.clone()
    assert cpu_fused.fake_quant(got, got, spec)
    assert _same(got, want)

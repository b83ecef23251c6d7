"""Per-format recipes: how activations travel and how weights are prepared.

A recipe quantizes a token's activations on its home rank into a byte payload (what is
dispatched), dequantizes received payloads once, requantizes the FC2 input (the SwiGLU
output) in the same activation format, and prepares the weights once at construction
(quantize with the recipe, keep the dequantized values; never re-dequantized per forward;
on CPU also the codes and scales, which the expert GEMM of few rows dequantizes in registers).

Non-finite activations: a token row holding NaN / inf is dispatched as NaN (the quantizers'
NaN block scale, `moe_ep.quant.nonfinite`; bf16: inf -> NaN), so that token's output row is
all NaN and no other row changes (docs/layer.md). Nothing is checked, so nothing syncs.

Formats (each matches the GPU kernel of the same taxonomy name; see docs/layer.md):
    bf16    activations and weights bf16; FC1 / FC2 in bf16 with fp32 accumulation.
    fp8     DeepSeek-V3 blockwise e4m3: activations 1x128, weights 128x128, fp32 scales;
            optionally FC1 rows gate/up interleaved before quantizing and the FC2 input in
            1x64 blocks (the sm90 pull kernel).
    mxfp8   e4m3 with one E8M0 byte per 32 elements (ceil rule), activations and weights.
    nvfp4   e2m1 with one e4m3 scale per 16 elements; per-tensor global scales applied as a
            per-expert alpha after each GEMM (static activation global scales from config).
    fp8_fp4 DeepGEMM recipe: activations e4m3 1x128 with UE8M0 (power-of-two) scales,
            weights mxfp4 (e2m1, one E8M0 byte per 32 elements, ceil rule).
    fp8_mxfp4 the sm90 MXFP4 x FP8 kernel (`mxfp4_hybrid`): activations e4m3 with one fp32
            scale per token (FC2 input: 1x64 fp32 blocks), weights mxfp4 (ceil rule) with
            the exponents clamped to 11 binades per expert (`moe_ep.quant.mxfp4_hybrid`).
    fp8_nvfp4 the sm90 NVFP4 x FP8 kernel: fp8_mxfp4's activations, nvfp4 weights with a
            per-expert decode scale, as the kernel's e4m3 operand `RN_E4M3(e2m1 * scale /
            8)` times `8 * G` (`moe_ep.quant.nvfp4_hopper`).
    mxfp8_mxfp4 the sm100 MXFP4 x MXFP8 kernel: mxfp8's activations with the FC1 input's
            exponents floored at -126 (normal scales), weights mxfp4 (ceil, likewise).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from moe_ep import quant
from moe_ep.backends.portable import cpu_fused
from moe_ep.backends.portable.cpu_fused import FakeQuant, PackedK16, Scale, StoredWeight
from moe_ep.errors import MoeEpUsageError
from moe_ep.types import MoEWeightPack

__all__ = [
    "Bf16Recipe",
    "Fp8BlockRecipe",
    "Fp8Fp4Recipe",
    "Fp8Mxfp4Recipe",
    "Fp8Nvfp4Recipe",
    "Mxfp8Mxfp4Recipe",
    "Mxfp8Recipe",
    "Nvfp4Recipe",
    "PreparedWeights",
    "Recipe",
    "check_recipe",
]


@dataclass(frozen=True)
class PreparedWeights:
    """Weights laid out as per-expert `mm` operands (`[E_local, K, N]` views), made once.

    w13t: `[E_local, H, 2I]` compute dtype (gate columns first), a transposed view of K-major
        `[E_local, 2I, H]` storage; fp32 (the bf16 values, exact) when the FC1 output is
        kept in fp32 (`Bf16Recipe(fc1_output_high_precision=True)`): FC1 then runs in fp32.
        None where `kpack13` replaces it (the `mm` blocks then widen from that copy).
    w2t: `[E_local, I, H]` compute dtype, likewise (None where `kpack2` replaces it).
    alpha13 / alpha2: `[E_local]` fp32 per-expert GEMM epilogue factors, or None.
    stored13 / stored2: on CPU, the same weights in their stored width (bf16: w13t's own
        storage; quantized formats: the codes and block scales the dequantized values came
        from) for the expert GEMM of few rows (`cpu_fused.expert_gemm`); None elsewhere and
        where `kpack13` / `kpack2` replace them.
    packed13 / packed2: per local expert, FC1's / FC2's bf16 weights in oneDNN's blocked GEMM
        layout (`PortableConfig.cpu_prepacked_weights`, `experts.prepack`), or None.
    kpack13 / kpack2: the same prepacking on CPUs without oneDNN's bf16 GEMMs: FC1's / FC2's
        bf16 weights packed for the expert GEMM's k order (`cpu_fused.pack_k16`), or None.
    operands_exact_in_bf16: the recipe's `operands_exact_in_bf16` (its expert GEMM operands
        can take the AMX order where the CPU has AMX).
    dense_dtypes: w13t's and w2t's dtypes (`fc1_dtype`, `compute_dtype`), kept where the
        packed copies replace them; taken from them when not given.
    """

    w13t: torch.Tensor | None
    w2t: torch.Tensor | None
    alpha13: torch.Tensor | None = None
    alpha2: torch.Tensor | None = None
    stored13: StoredWeight | None = None
    stored2: StoredWeight | None = None
    packed13: tuple[torch.Tensor, ...] | None = None
    packed2: tuple[torch.Tensor, ...] | None = None
    kpack13: PackedK16 | None = None
    kpack2: PackedK16 | None = None
    operands_exact_in_bf16: bool = False
    dense_dtypes: tuple[torch.dtype, torch.dtype] | None = None

    def __post_init__(self) -> None:
        for dense, packed, name in ((self.w13t, self.kpack13, "13"), (self.w2t, self.kpack2, "2")):
            if dense is None and packed is None:
                raise ValueError(f"PreparedWeights needs w{name}t or kpack{name}")
        if self.dense_dtypes is None:
            if self.w13t is None or self.w2t is None:
                raise ValueError("PreparedWeights needs dense_dtypes without w13t and w2t")
            object.__setattr__(self, "dense_dtypes", (self.w13t.dtype, self.w2t.dtype))

    @property
    def fc1_dtype(self) -> torch.dtype:
        """w13t's dtype: FC1's output (fp32 where kept in fp32)."""
        assert self.dense_dtypes is not None
        return self.dense_dtypes[0]

    @property
    def compute_dtype(self) -> torch.dtype:
        """w2t's dtype: the activations' and FC2's."""
        assert self.dense_dtypes is not None
        return self.dense_dtypes[1]

    @property
    def num_experts(self) -> int:
        """E_local."""
        return int(self.w2t.shape[0] if self.w2t is not None else self._kpack2.codes.shape[0])

    @property
    def hidden(self) -> int:
        """H: FC1's K and FC2's N."""
        return int(self.w2t.shape[2]) if self.w2t is not None else self._kpack2.n

    @property
    def inter(self) -> int:
        """I: FC2's K."""
        return int(self.w2t.shape[1]) if self.w2t is not None else self._kpack2.k

    @property
    def _kpack2(self) -> PackedK16:
        """FC2's packed copy, where it replaces w2t (`__post_init__` checks one is set)."""
        assert self.kpack2 is not None
        return self.kpack2


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`[m, c]` tensor -> `[m, c * itemsize]` uint8 view of its bytes."""
    return t.contiguous().view(torch.uint8)


def _split(payload: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    for w in widths:
        out.append(payload[:, start : start + w].contiguous())
        start += w
    return out


class Recipe(ABC):
    """One activation/weight format."""

    name: str = ""
    compute_dtype: torch.dtype = torch.float32
    quantized_weight_dtypes: tuple[torch.dtype, ...] = ()
    """Payload dtypes accepted in a pre-quantized `MoEWeightPack` (empty: none)."""
    k_multiple: int = 1
    """H and I must be multiples of this (the format's block along K)."""
    requantize_is_rounding: bool = False
    """True when `requantize` is the identity: rounding the fp32 SwiGLU output to the compute
    dtype is the whole FC2-input quantization (lets the experts fuse the rounding)."""
    operands_exact_in_bf16: bool = False
    """True when every dequantized activation (FC1 and FC2 inputs) and weight value of this
    format is exact in bf16 (power-of-two or e4m3 scales on e4m3 / e2m1 codes): the CPU
    expert GEMM can then sum them in the AMX order (`cpu_fused.expert_gemm(vector="amx")`)."""
    block_scaled: bool = False
    """True when the format's GEMMs can be summed from the activations' codes in the
    block-scaled AMX order (e4m3 activations with fp32 scales, and e4m3 weights with fp32
    block scales, fp8, or weights exact in bf16, the sm90 hybrids): on a CPU with AMX its
    dispatched rows keep their codes (`keeps_codes`) and the experts run there."""

    def keeps_codes(self, device: torch.device) -> bool:
        """Whether the dispatch hands the experts the rows' e4m3 codes and scales
        (`Dispatched.codes`, from `codes_of`): a `block_scaled` format on a CPU where the
        block-scaled order runs (`cpu_fused.block_scaled_by_default`)."""
        return self.block_scaled and device.type == "cpu" and cpu_fused.block_scaled_by_default()

    def codes_of(self, payload: torch.Tensor, hidden: int) -> cpu_fused.E4m3Rows:
        """The codes and scales inside a `[m, row_bytes(H)]` payload, as views."""
        raise MoeEpUsageError(f"format {self.name} keeps no e4m3 codes")

    def _prepared(
        self,
        w13t: torch.Tensor,
        w2t: torch.Tensor,
        alpha13: torch.Tensor | None = None,
        alpha2: torch.Tensor | None = None,
        stored13: StoredWeight | None = None,
        stored2: StoredWeight | None = None,
    ) -> PreparedWeights:
        """`PreparedWeights` of these parts carrying this format's `operands_exact_in_bf16`."""
        return PreparedWeights(
            w13t, w2t, alpha13, alpha2, stored13, stored2,
            operands_exact_in_bf16=self.operands_exact_in_bf16,
        )  # fmt: skip

    def check_dims(self, hidden: int, intermediate: int) -> None:
        m = self.k_multiple
        if hidden % m or intermediate % m:
            raise MoeEpUsageError(
                f"format {self.name} needs hidden_size and intermediate size to be multiples "
                f"of {m}, got H={hidden}, I={intermediate}"
            )

    scale_desc: str = ""
    """The scale dtype in words, for messages."""

    def scale_shape(self, w: torch.Tensor) -> tuple[int, ...]:
        """Canonical scale shape of a pre-quantized payload `w [E_local, rows, cols]`."""
        raise MoeEpUsageError(f"format {self.name} takes no pre-quantized weights")

    def check_scales(self, weights: MoEWeightPack) -> None:
        """Shape checks of a pre-quantized pack's scale planes (before any collective)."""
        if not weights.prequantized:
            return
        for name in ("w13", "w2"):
            w, s = getattr(weights, name), getattr(weights, f"{name}_scale")
            _check_scale_shape(f"{name}_scale", s, self.scale_shape(w), self.scale_desc)
            gs = getattr(weights, f"{name}_global_scale")
            if gs is not None:
                _check_scale_shape(f"{name}_global_scale", gs, (int(w.shape[0]),), "fp32")

    @abstractmethod
    def row_bytes(self, hidden: int) -> int:
        """Bytes of one dispatched token row of `hidden` elements."""

    @abstractmethod
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """`[n, H]` bf16 -> `[n, row_bytes(H)]` uint8 (quantized on the home rank)."""

    @abstractmethod
    def unpack(self, payload: torch.Tensor, hidden: int) -> torch.Tensor:
        """`[m, row_bytes(H)]` uint8 -> `[m, H]` compute dtype (dequantized, no global scale)."""

    @abstractmethod
    def requantize(self, h: torch.Tensor) -> torch.Tensor:
        """FC2 input: `[m, I]` fp32 SwiGLU output -> quantize-dequantized values (any float
        dtype; the caller copies them into the compute-dtype FC2 input)."""

    fake_quant: FakeQuant | None = None
    """`requantize` as the fused CPU pass does it (`cpu_fused.fake_quant`, same bits), or
    None where the format has none."""

    dispatch_fake_quant: FakeQuant | None = None
    """`unpack(pack(x))` as the fused CPU pass does it (`cpu_fused.fake_quant`, same bits),
    or None where the format has none."""

    def pack_unpack(self, x: torch.Tensor) -> torch.Tensor | None:
        """`unpack(pack(x))` of `[n, H]` bf16 rows in one fused CPU pass (fp32, the compute
        dtype of the formats that have one), for rows that stay on this rank; None where
        the format or the pass does not apply (the caller packs and unpacks)."""
        spec = self.dispatch_fake_quant
        if spec is None or x.device.type != "cpu":
            return None
        out = x.to(torch.float32, copy=True)  # then in place: one fp32 copy, as unpack's
        return out if cpu_fused.fake_quant(out, out, spec) else None

    def requantize_into(self, h: torch.Tensor, out: torch.Tensor) -> None:
        """`out[:] = requantize(h)`, rounded to out's dtype: in one fused pass on CPU where
        the format has one (`fake_quant`), else the eager ops and a copy."""
        if self.fake_quant is None or not cpu_fused.fake_quant(h, out, self.fake_quant):
            out.copy_(self.requantize(h))

    @abstractmethod
    def prepare(self, weights: MoEWeightPack) -> PreparedWeights:
        """Quantize (or take the pre-quantized payload), dequantize once, lay out."""


def check_recipe(recipe: object) -> None:
    """`MoeEpUsageError` unless `recipe` is a `Recipe` (e.g. `Bf16Recipe()`)."""
    if not isinstance(recipe, Recipe):
        raise MoeEpUsageError(
            f"recipe must be a moe_ep.backends.portable.recipes.Recipe (e.g. Bf16Recipe()), "
            f"got {type(recipe).__name__}"
        )


def _stored(
    codes: torch.Tensor,
    scales: torch.Tensor | None = None,
    scale: Scale | None = None,
    block: int = 0,
) -> StoredWeight | None:
    """`codes` (bf16, fp8 e4m3 or packed e2m1 uint8) and their per-row block scales as the CPU
    expert GEMM reads them; None for weights off the CPU (no copy kept there)."""
    if codes.device.type != "cpu":
        return None
    code = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3", torch.uint8: "e2m1"}
    as_bytes = codes if codes.dtype == torch.bfloat16 else codes.contiguous().view(torch.uint8)
    scale_bytes = None
    if scales is not None:
        scale_bytes = scales.contiguous()
        scale_bytes = scale_bytes if scale == "fp32" else scale_bytes.view(torch.uint8)
    return StoredWeight(as_bytes.contiguous(), code[codes.dtype], scale_bytes, scale, block)  # type: ignore[arg-type]


def _fp8_row_scales(s: torch.Tensor, rows: int) -> torch.Tensor:
    """128x128 block scales `[E, ceil(N/128), K/128]` -> one row per weight row `[E, N, K/128]`."""
    return s.repeat_interleave(128, dim=-2)[..., :rows, :].contiguous()


def _float_weights(weights: MoEWeightPack, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    if weights.prequantized:
        raise MoeEpUsageError(f"format {fmt} takes unquantized weights only")
    return weights.w13, weights.w2


def _layout(w13: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (
        # [E, K, N] views of K-contiguous [E, N, K] storage: oneDNN's fast layout (and the
        # one CUDA grouped GEMMs want). bf16 weights already on the device are not copied.
        w13.to(dtype).contiguous().transpose(1, 2),
        w2.to(dtype).contiguous().transpose(1, 2),
    )


class Bf16Recipe(Recipe):
    """bf16 activations and weights.

    Args:
        fc1_output_high_precision: keep FC1's output `[g; u]` in fp32 into SwiGLU (the fused
            sm90 bf16 pull kernel's numerics, the oracle's option of the same name) instead
            of rounding it to bf16 as a bf16 GEMM writes it. Costs an fp32 copy of w13 (the
            `mm` path's FC1 operand; the CPU expert GEMM reads the bf16 one and writes fp32).
    """

    name = "bf16"
    compute_dtype = torch.bfloat16
    requantize_is_rounding = True

    def __init__(self, fc1_output_high_precision: bool = False) -> None:
        if type(fc1_output_high_precision) is not bool:
            raise MoeEpUsageError(
                f"fc1_output_high_precision must be a bool, got {fc1_output_high_precision!r}"
            )
        self.fc1_output_high_precision = fc1_output_high_precision

    def row_bytes(self, hidden: int) -> int:
        return 2 * hidden

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        # +-inf -> NaN: the row then comes out all NaN, as in the quantized formats (a NaN
        # block scale); an inf alone can come out finite (a SwiGLU clamp) or inf.
        return _bytes(quant.nonfinite_to_nan(x))

    def unpack(self, payload: torch.Tensor, hidden: int) -> torch.Tensor:
        return payload.contiguous().view(torch.bfloat16)

    def requantize(self, h: torch.Tensor) -> torch.Tensor:
        return h  # the caller's copy into the bf16 FC2 input rounds it (RNE)

    def prepare(self, weights: MoEWeightPack) -> PreparedWeights:
        w13, w2 = _float_weights(weights, self.name)
        w13t, w2t = _layout(w13, w2, torch.bfloat16)
        stored13, stored2 = _stored(w13t.transpose(1, 2)), _stored(w2t.transpose(1, 2))
        if self.fc1_output_high_precision:
            w13t = w13t.float()  # keeps the [E, K, N] view of K-contiguous storage
        return PreparedWeights(w13t, w2t, stored13=stored13, stored2=stored2)


def _check_scale_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], dtype: str) -> None:
    if tuple(t.shape) != expected:
        raise MoeEpUsageError(
            f"{name} must be {dtype} {list(expected)} (canonical, unswizzled), got {tuple(t.shape)}"
        )


class Fp8BlockRecipe(Recipe):
    """DeepSeek-V3 blockwise fp8 (e4m3; activations 1x128, weights 128x128; fp32 scales).

    Args:
        fc1_gate_up_interleave: None or b: FC1 rows are quantized gate/up-interleaved in
            blocks of b (see `Any_Fp8_Fp8_Bf16_Torch_MegaMoeConfig.fc1_gate_up_interleave`).
        fc2_act_block: elements per scale of the FC2 input (the SwiGLU output); None is the
            format's activation block (`act_block`). Validated by the config.
    """

    name = "fp8"
    quantized_weight_dtypes = (torch.float8_e4m3fn,)
    k_multiple = 128
    act_block = 128
    """Activation elements per scale along K: the FC1 input (dispatched), and the FC2 input
    unless `fc2_act_block` says otherwise."""
    act_scale_format = "fp32"
    scale_desc = "fp32"
    block_scaled = True

    def scale_shape(self, w: torch.Tensor) -> tuple[int, ...]:
        e, rows, cols = (int(d) for d in w.shape)
        return (e, -(-rows // 128), cols // 128)

    def row_bytes(self, hidden: int) -> int:
        return hidden + 4 * (hidden // self.act_block)

    def _qdq_parts(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quant.quantize_fp8_blockwise(
            x, block=(1, block), scale_format=self.act_scale_format, check_finite=False
        )

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        payload = self._pack_fused(x)
        if payload is not None:
            return payload
        data, scales = self._qdq_parts(x, self.act_block)
        return torch.cat([_bytes(data), _bytes(scales)], dim=1)

    def _pack_fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """`pack` by the fused CPU pass (`cpu_fused.quant_e4m3`): the eager bytes for
        finite blocks (a block with NaN or inf: NaN scale and codes, which unpack to NaN as
        the eager ones do); None where it does not apply."""
        hidden = int(x.shape[-1])
        spec = self.dispatch_fake_quant
        if spec is None or x.device.type != "cpu" or x.dim() != 2 or hidden % self.act_block:
            return None
        payload = torch.empty(int(x.shape[0]), self.row_bytes(hidden), dtype=torch.uint8)
        part = self.codes_of(payload, hidden)
        ok = cpu_fused.quant_e4m3(x.to(torch.float32), part.codes, part.scales, spec)
        return payload if ok else None

    def codes_of(self, payload: torch.Tensor, hidden: int) -> cpu_fused.E4m3Rows:
        scales = payload[:, hidden : hidden + 4 * (hidden // self.act_block)]
        return cpu_fused.E4m3Rows(payload[:, :hidden], scales.view(torch.float32), self.act_block)

    def unpack(self, payload: torch.Tensor, hidden: int) -> torch.Tensor:
        part = self.codes_of(payload, hidden)
        return quant.dequantize_fp8_blockwise(
            part.codes.view(torch.float8_e4m3fn), part.scales, block=(1, self.act_block)
        )

    def requantize(self, h: torch.Tensor) -> torch.Tensor:
        data, scales = self._qdq_parts(h, self.fc2_act_block)
        return quant.dequantize_fp8_blockwise(data, scales, block=(1, self.fc2_act_block))

    def __init__(
        self, fc1_gate_up_interleave: int | None = None, fc2_act_block: int | None = None
    ) -> None:
        self.fc1_gate_up_interleave = fc1_gate_up_interleave
        self.fc2_act_block = self.act_block if fc2_act_block is None else fc2_act_block
        kind = "fp8_ue8m0" if self.act_scale_format == "ue8m0" else "fp8"
        self.fake_quant = FakeQuant(kind, self.fc2_act_block)
        self.dispatch_fake_quant = FakeQuant(kind, self.act_block)

    def check_scales(self, weights: MoEWeightPack) -> None:
        if weights.prequantized and self.fc1_gate_up_interleave is not None:
            raise MoeEpUsageError(
                f"fc1_gate_up_interleave={self.fc1_gate_up_interleave} needs bf16/fp32 weights "
                "to quantize; a pre-quantized pack's scales already fix its FC1 block grouping "
                "(use fc1_gate_up_interleave=None for it)"
            )
        super().check_scales(weights)

    def _weight(
        self, name: str, w: torch.Tensor, s: torch.Tensor | None
    ) -> tuple[torch.Tensor, StoredWeight | None]:
        """(dequantized fp32, the codes and per-row scales)."""
        if s is None:
            w, s = quant.quantize_fp8_blockwise(w, block=(128, 128))
        s32 = s if s.dtype == torch.float32 else quant.e8m0_to_float32(s)  # as dequantize does
        stored = _stored(w, _fp8_row_scales(s32, int(w.shape[-2])), "fp32", 128)
        return quant.dequantize_fp8_blockwise(w, s, block=(128, 128)), stored

    def _fc1_weight(
        self, w13: torch.Tensor, s: torch.Tensor | None
    ) -> tuple[torch.Tensor, StoredWeight | None]:
        b = self.fc1_gate_up_interleave
        if b is None:
            return self._weight("w13", w13, s)
        w, stored = self._weight("w13", quant.interleave_gate_up(w13, b), s)
        if stored is not None:  # codes and their per-row scales back to gate-then-up rows
            assert stored.scales is not None
            stored = StoredWeight(
                quant.deinterleave_gate_up(stored.codes, b), stored.code,
                quant.deinterleave_gate_up(stored.scales, b), stored.scale, stored.block,
            )  # fmt: skip
        return quant.deinterleave_gate_up(w, b), stored

    def prepare(self, weights: MoEWeightPack) -> PreparedWeights:
        w13, stored13 = self._fc1_weight(weights.w13, weights.w13_scale)
        w2, stored2 = self._weight("w2", weights.w2, weights.w2_scale)
        w13t, w2t = _layout(w13, w2, torch.float32)
        return self._prepared(w13t, w2t, stored13=stored13, stored2=stored2)


class Mxfp8Recipe(Recipe):
    """mxfp8: e4m3 elements, one E8M0 byte per 32 along K (ceil rule), acts and weights."""

    name = "mxfp8"
    operands_exact_in_bf16 = True
    quantized_weight_dtypes = (torch.float8_e4m3fn,)
    k_multiple = 32
    scale_desc = "E8M0 uint8"
    act_normal_scales = False
    """FC1-input exponents at least -126 (`quant.quantize_mxfp8(normal_scales=)`)."""

    def scale_shape(self, w: torch.Tensor) -> tuple[int, ...]:
        e, rows, cols = (int(d) for d in w.shape)
        return (e, rows, cols // 32)

    def row_bytes(self, hidden: int) -> int:
        return hidden + hidden // 32

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        data, scales = quant.quantize_mxfp8(
            x, check_finite=False, normal_scales=self.act_normal_scales
        )
        return torch.cat([_bytes(data), scales], dim=1)

    def unpack(self, payload: torch.Tensor, hidden: int) -> torch.Tensor:
        data, scales = _split(payload, [hidden, hidden // 32])
        return quant.dequantize_mxfp8(data.view(torch.float8_e4m3fn), scales)

    def requantize(self, h: torch.Tensor) -> torch.Tensor:
        return quant.dequantize_mxfp8(*quant.quantize_mxfp8(h, check_finite=False))

    fake_quant = FakeQuant("mxfp8", 32)
    dispatch_fake_quant: FakeQuant | None = FakeQuant("mxfp8", 32)

    def _weight(
        self, name: str, w: torch.Tensor, s: torch.Tensor | None
    ) -> tuple[torch.Tensor, StoredWeight | None]:
        if s is None:
            w, s = quant.quantize_mxfp8(w)
        return quant.dequantize_mxfp8(w, s), _stored(w, s, "e8m0", 32)

    def prepare(self, weights: MoEWeightPack) -> PreparedWeights:
        w13, stored13 = self._weight("w13", weights.w13, weights.w13_scale)
        w2, stored2 = self._weight("w2", weights.w2, weights.w2_scale)
        w13t, w2t = _layout(w13, w2, torch.float32)
        return self._prepared(w13t, w2t, stored13=stored13, stored2=stored2)


class Nvfp4Recipe(Recipe):
    """nvfp4: e2m1 (packed, low nibble first), e4m3 scale per 16, global scales as alpha.

    Activations use static global scales (`act_global_scale` for FC1 input,
    `hidden_global_scale` for FC2 input), like a calibrated `input_scale`: a per-batch
    amax would make a token's result depend on its batch.
    """

    name = "nvfp4"
    operands_exact_in_bf16 = True
    quantized_weight_dtypes = (torch.uint8,)
    k_multiple = 16
    scale_desc = "e4m3"

    def scale_shape(self, w: torch.Tensor) -> tuple[int, ...]:
        e, rows, half = (int(d) for d in w.shape)
        return (e, rows, half * 2 // 16)

    def __init__(self, act_global_scale: float = 1.0, hidden_global_scale: float = 1.0) -> None:
        self.act_gs = float(act_global_scale)
        self.hidden_gs = float(hidden_global_scale)
        self.fake_quant = FakeQuant("nvfp4", 16, self.hidden_gs)
        self.dispatch_fake_quant = FakeQuant("nvfp4", 16, self.act_gs)

    def row_bytes(self, hidden: int) -> int:
        return hidden // 2 + hidden // 16

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        packed, scales = quant.quantize_nvfp4(x, norm_const=self.act_gs, check_finite=False)
        return torch.cat([packed, _bytes(scales)], dim=1)

    def unpack(self, payload: torch.Tensor, hidden: int) -> torch.Tensor:
        packed, scales = _split(payload, [hidden // 2, hidden // 16])
        return quant.dequantize_nvfp4(packed, scales.view(torch.float8_e4m3fn))

    def requantize(self, h: torch.Tensor) -> torch.Tensor:
        packed, scales = quant.quantize_nvfp4(h, norm_const=self.hidden_gs, check_finite=False)
        # Dequantized without the global scale: it is folded into alpha2.
        return quant.dequantize_nvfp4(packed, scales)

    def _weight(
        self, name: str, w: torch.Tensor, s: torch.Tensor | None, gs: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, StoredWeight | None]:
        e = int(w.shape[0])
        if s is None:
            gs_t = quant.nvfp4_global_scale(w, dim=(-2, -1))
            w, s = quant.quantize_nvfp4(w, norm_const=gs_t)
            gs = gs_t.reshape(e)
        elif gs is None:
            gs = torch.ones(e, dtype=torch.float32, device=w.device)
        stored = _stored(w, s, "e4m3", 16)
        return quant.dequantize_nvfp4(w, s), gs.float().reshape(e), stored

    def prepare(self, weights: MoEWeightPack) -> PreparedWeights:
        w13, gs13, stored13 = self._weight(
            "w13", weights.w13, weights.w13_scale, weights.w13_global_scale
        )
        w2, gs2, stored2 = self._weight("w2", weights.w2, weights.w2_scale, weights.w2_global_scale)
        w13t, w2t = _layout(w13, w2, torch.float32)
        alpha13 = torch.as_tensor(quant.nvfp4_alpha(self.act_gs, gs13), dtype=torch.float32)
        alpha2 = torch.as_tensor(quant.nvfp4_alpha(self.hidden_gs, gs2), dtype=torch.float32)
        return self._prepared(w13t, w2t, alpha13, alpha2, stored13, stored2)


class Fp8Fp4Recipe(Fp8BlockRecipe):
    """DeepGEMM fp8 x fp4 (its mega-MoE recipe (1, 1, 32)): e4m3 1x32 activations with UE8M0
    scales, mxfp4 weights (e2m1, E8M0 per 32)."""

    name = "fp8_fp4"
    operands_exact_in_bf16 = True
    block_scaled = False  # mxfp4 weights: the AMX order on the dequantized values
    quantized_weight_dtypes = (torch.uint8,)
    k_multiple = 32
    act_block = 32
    act_scale_format = "ue8m0"
    scale_desc = "E8M0 uint8"

    def scale_shape(self, w: torch.Tensor) -> tuple[int, ...]:
        e, rows, half = (int(d) for d in w.shape)
        return (e, rows, half * 2 // 32)

    def _weight(
        self, name: str, w: torch.Tensor, s: torch.Tensor | None
    ) -> tuple[torch.Tensor, StoredWeight | None]:
        return _mxfp4_weight(w, s, clamp_range=False)


def _mxfp4_weight(
    w: torch.Tensor, s: torch.Tensor | None, *, clamp_range: bool, normal_scales: bool = False
) -> tuple[torch.Tensor, StoredWeight | None]:
    """mxfp4 weights (quantized with the ceil rule, `normal_scales` as given, unless `s` is
    given), optionally with the sm90 kernel's per-expert exponent-range clamp ->
    (dequantized fp32, codes and scales)."""
    if s is None:
        w, s = quant.quantize_mxfp4(w, normal_scales=normal_scales)
    if clamp_range:
        w, s = quant.clamp_mxfp4_exponent_range(w, s.view(torch.uint8))
    return quant.dequantize_mxfp4(w, s), _stored(w, s, "e8m0", 32)


class _HybridFp8Recipe(Recipe):
    """The sm90 pull kernels' `mxfp4_hybrid` activations (`moe_ep.quant.mxfp4_hybrid`): e4m3
    FC1 input with one fp32 scale per token, e4m3 FC2 input in 1x64 fp32 blocks. H and I
    multiples of 128. Subclasses add the weights."""

    quantized_weight_dtypes = (torch.uint8,)
    k_multiple = 128

    block_scaled = True  # e4m3 codes with fp32 scales x weights exact in bf16

    def row_bytes(self, hidden: int) -> int:
        return hidden + 4

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        data, scale = quant.quantize_fp8_per_token_hybrid(x, check_finite=False)
        return torch.cat([_bytes(data), _bytes(scale)], dim=1)

    def codes_of(self, payload: torch.Tensor, hidden: int) -> cpu_fused.E4m3Rows:
        scale = payload[:, hidden : hidden + 4].view(torch.float32)
        return cpu_fused.E4m3Rows(payload[:, :hidden], scale, hidden)  # one scale per token

    def unpack(self, payload: torch.Tensor, hidden: int) -> torch.Tensor:
        part = self.codes_of(payload, hidden)
        return quant.dequantize_fp8_per_row(part.codes.view(torch.float8_e4m3fn), part.scales)

    def requantize(self, h: torch.Tensor) -> torch.Tensor:
        data, scales = quant.quantize_fp8_fc2_hybrid(h, check_finite=False)
        return quant.dequantize_fp8_blockwise(data, scales, block=(1, quant.HYBRID_FC2_BLOCK))

    fake_quant = FakeQuant("fp8_hybrid", quant.HYBRID_FC2_BLOCK)


class Fp8Mxfp4Recipe(_HybridFp8Recipe):
    """The sm90 MXFP4 x FP8 kernel (`mxfp4_hybrid`, `moe_ep.quant.mxfp4_hybrid`): the hybrid
    activations, mxfp4 weights (ceil rule) with the exponents clamped to 11 binades per
    expert."""

    name = "fp8_mxfp4"
    scale_desc = "E8M0 uint8"
    scale_shape = Fp8Fp4Recipe.scale_shape  # the same mxfp4 packs: one E8M0 byte per 32

    def check_scales(self, weights: MoEWeightPack) -> None:
        super().check_scales(weights)
        for name in ("w13_scale", "w2_scale"):
            s = getattr(weights, name)
            if s is not None and s.numel() and bool((s.view(torch.uint8) == 255).any()):
                raise MoeEpUsageError(
                    f"{name} holds E8M0 byte 255 (NaN); the per-expert exponent clamp needs "
                    "finite scales"
                )

    def prepare(self, weights: MoEWeightPack) -> PreparedWeights:
        w13, stored13 = _mxfp4_weight(weights.w13, weights.w13_scale, clamp_range=True)
        w2, stored2 = _mxfp4_weight(weights.w2, weights.w2_scale, clamp_range=True)
        w13t, w2t = _layout(w13, w2, torch.float32)
        return self._prepared(w13t, w2t, stored13=stored13, stored2=stored2)


class Fp8Nvfp4Recipe(_HybridFp8Recipe):
    """The sm90 NVFP4 x FP8 kernel (`moe_ep.quant.nvfp4_hopper`): the hybrid activations,
    nvfp4 weights with a per-expert decode scale G (weight = G * e2m1 * scale, the host
    rule of `quantize_nvfp4_decode_scaled`), multiplied as the kernel does: the operand
    `RN_E4M3(e2m1 * scale / 8)` (`nvfp4_e4m3_operand`) and `8 * G` per expert as the GEMM's
    alpha.

    A pre-quantized pack gives e2m1 codes `[E, N, K/2]` uint8, e4m3 scales `[E, N, K/16]`
    (finite, non-negative: bytes 0..126) and optionally `w13_global_scale` /
    `w2_global_scale` `[E_local]` fp32: the decode scale G (the checkpoint's `weight_scale_2`;
    not the sm100 format's norm_const); without them G = 1.
    """

    name = "fp8_nvfp4"
    scale_desc = "e4m3"
    scale_shape = Nvfp4Recipe.scale_shape  # one e4m3 scale per 16

    def check_scales(self, weights: MoEWeightPack) -> None:
        super().check_scales(weights)
        for name in ("w13", "w2"):
            s = getattr(weights, f"{name}_scale")
            if s is None:
                continue
            if s.dtype not in (torch.float8_e4m3fn, torch.uint8):
                raise MoeEpUsageError(
                    f"{name}_scale must be e4m3 (or its uint8 bytes), got {s.dtype}"
                )
            if s.numel() and bool((s.view(torch.uint8) > 126).any()):
                raise MoeEpUsageError(
                    f"{name}_scale holds negative or NaN e4m3 bytes (> 126); the kernel takes "
                    "finite non-negative scales"
                )
            g = getattr(weights, f"{name}_global_scale")
            if g is not None and (
                g.dtype != torch.float32 or not bool((torch.isfinite(g) & (g > 0)).all())
            ):
                raise MoeEpUsageError(
                    f"{name}_global_scale (the decode scale G) must be positive finite fp32, "
                    f"got {g.dtype}"
                )

    def _weight(
        self, w: torch.Tensor, s: torch.Tensor | None, g: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, StoredWeight | None]:
        """(the kernel's operand values in fp32, `8 * G` per expert, the operand's codes)."""
        e = int(w.shape[0])
        if s is None:
            g = quant.nvfp4_decode_scale(w, dim=(-2, -1))
            w, s = quant.quantize_nvfp4_decode_scaled(w, decode_scale=g)
        elif g is None:
            g = torch.ones(e, dtype=torch.float32, device=w.device)
        operand = quant.nvfp4_e4m3_operand(w, s.view(torch.float8_e4m3fn))
        alpha = (g.reshape(e) * quant.NVFP4_EPILOGUE_COMPENSATION).contiguous()
        return operand.float(), alpha, _stored(operand)

    def prepare(self, weights: MoEWeightPack) -> PreparedWeights:
        w13, alpha13, stored13 = self._weight(
            weights.w13, weights.w13_scale, weights.w13_global_scale
        )
        w2, alpha2, stored2 = self._weight(weights.w2, weights.w2_scale, weights.w2_global_scale)
        w13t, w2t = _layout(w13, w2, torch.float32)
        return self._prepared(w13t, w2t, alpha13, alpha2, stored13, stored2)


class Mxfp8Mxfp4Recipe(Mxfp8Recipe):
    """The sm100 MXFP4 x MXFP8 kernel (`sm100_mxfp8_mxfp4_bf16_cutedsl`): mxfp8 activations
    (e4m3, E8M0 per 32, ceil rule; the FC1 input with normal scales, exponents >= -126, as
    its staging; the FC2 input as mxfp8's, in-kernel), mxfp4 weights (e2m1, E8M0 per 32,
    ceil rule, normal scales, as its host quantizer). H and I multiples of 128."""

    name = "mxfp8_mxfp4"
    quantized_weight_dtypes = (torch.uint8,)
    k_multiple = 128
    act_normal_scales = True
    dispatch_fake_quant = None  # the fused pass has no normal-scales rule
    scale_shape = Fp8Fp4Recipe.scale_shape  # mxfp4 packs: one E8M0 byte per 32

    def prepare(self, weights: MoEWeightPack) -> PreparedWeights:
        w13, stored13 = _mxfp4_weight(
            weights.w13, weights.w13_scale, clamp_range=False, normal_scales=True
        )
        w2, stored2 = _mxfp4_weight(
            weights.w2, weights.w2_scale, clamp_range=False, normal_scales=True
        )
        w13t, w2t = _layout(w13, w2, torch.float32)
        return self._prepared(w13t, w2t, stored13=stored13, stored2=stored2)

"""`sm100_mxfp8_mxfp4_bf16_cutedsl` against its drop, without a GPU: the drop's
`BlackwellInferenceMegaMoE` built from exactly our descriptors compiles for sm_100a with our
call arguments and is refused for sm_90a (a Hopper target has no tcgen05 block-scaled MMA);
our argument specs equal the ABI the drop's own `aot_compile` declares; the call's keyword
names are the kernel's; the combine region we locate is the kernel's. Each in a fresh
process (cutlass reads the target arch at import)."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from backend_testing import require_drop, run_compile_check, run_fresh_python

from moe_ep.backends.support.cutedsl.compile_fakes import DEFAULT_CHECK_GEOMETRY
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl import args
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.upstream import NEXT_DROP

KERNEL = "sm100_mxfp8_mxfp4_bf16_cutedsl"
CUTLASS_DTYPES = {
    "fp8_e4m3": "Float8E4M3FN",
    "e8m0": "Float8E8M0FNU",
    "int32": "Int32",
    "float32": "Float32",
    "fp4": "Float4E2M1FN",
    "bfloat16": "BFloat16",
}


def _compile(tmp_path: Path, arch: str) -> dict:
    require_drop(NEXT_DROP)
    return run_compile_check(tmp_path, "moe_ep_sm100.compile_check", arch, "mxfp8_mxfp4")


def test_kernel_compiles_for_sm100a(tmp_path: Path) -> None:
    result = _compile(tmp_path, "sm_100a")
    assert result["ok"], result
    assert result["kernel"] == KERNEL and result["arch"] == "sm_100a"


def test_kernel_refuses_a_hopper_target(tmp_path: Path) -> None:
    result = _compile(tmp_path, "sm_90a")
    assert not result["ok"]
    assert "sm_100a" in result["error"] and "got sm_90a" in result["error"]


# The drop's aot_compile with cute.compile captured: the fake arguments that define its ABI.
_PROBE = """
import json, os
os.environ["CUTE_DSL_ARCH"] = "sm_100a"
import cutlass.cute as cute
from moe_ep.backends.support.cutedsl.compile_fakes import DEFAULT_CHECK_GEOMETRY as g
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl import args, kernel as kmod
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.config import (
    Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig as C,
)
from moe_ep_sm100.kernels.sm100_mxfp8_mxfp4_bf16_cutedsl.upstream import load_api
import inspect
api = load_api()
kernel, clusters = args.build_kernel(C(), g, api, sm_count=148)
seen = {}
class Capture:
    def __getitem__(self, _option):
        return lambda _kernel, **kw: seen.update(kw)
cute.compile = Capture()
kernel.aot_compile()
abi = {
    n: [str(t.shape), str(t.element_type), str(t.stride)]
    for n, t in seen.items() if hasattr(t, "element_type")
}
call = inspect.signature(type(kernel).__call__.__wrapped__ if hasattr(type(kernel).__call__,
    "__wrapped__") else type(kernel).__call__)
print(json.dumps({
    "abi": abi,
    "others": sorted(n for n, t in seen.items() if not hasattr(t, "element_type")),
    "params": [p for p in call.parameters if p != "self"],
    "required": [n for n, p in call.parameters.items()
                 if n != "self" and p.default is inspect.Parameter.empty],
    "region": list(kmod.combine_region(kernel, g)),
    "masks_invalid_combine_slots": bool(kernel.masks_invalid_combine_slots),
    "clusters": clusters,
}))
"""


@pytest.fixture(scope="module")
def probe() -> dict:
    require_drop(NEXT_DROP)
    return run_fresh_python(textwrap.dedent(_PROBE), timeout=240)


def _extents(shape: str) -> list[int | None]:
    """`(?{i64 div=128}, 1024)` -> [None, 1024] (None: a dynamic extent)."""
    return [None if p.startswith("?") else int(p) for p in re.split(r",\s*", shape.strip("()"))]


def test_argument_specs_are_the_abi_of_the_drops_aot_compile(probe: dict) -> None:
    g = DEFAULT_CHECK_GEOMETRY
    specs = {args.KERNEL_ARG_NAMES.get(s.name, s.name): s for s in args.tensor_specs(g)}
    abi = probe["abi"]
    assert set(abi) == set(specs)
    for name, spec in specs.items():
        shape, dtype, stride = abi[name]
        assert dtype == CUTLASS_DTYPES[spec.dtype], name
        for ours, theirs in zip(spec.shape, _extents(shape), strict=True):
            assert theirs is None or ours == theirs, (name, spec.shape, shape)
        assert _extents(stride)[spec.leading_dim] == 1, (name, stride)  # stride-1 mode
    assert probe["others"] == sorted(
        ["local_workspace", "shared_workspace", "peer_rank_ptr_mapper_host", "stream"]
    )


def test_call_arguments_are_the_kernels_keywords(probe: dict) -> None:
    names = set(args.KERNEL_ARG_NAMES.get(s.name, s.name) for s in args.tensor_specs(
        DEFAULT_CHECK_GEOMETRY)) | {"local_workspace", "shared_workspace",
                                    "peer_rank_ptr_mapper_host", "stream"}  # fmt: skip
    assert names <= set(probe["params"])
    assert set(probe["required"]) <= names


def test_combine_region_is_the_kernels_and_it_masks_invalid_slots(probe: dict) -> None:
    g = DEFAULT_CHECK_GEOMETRY
    offset, nbytes = probe["region"]
    assert offset >= 0 and nbytes == g.max_tokens_per_rank * g.top_k * g.hidden_size * 2
    assert probe["masks_invalid_combine_slots"] is True
    assert probe["clusters"] == 148 // 2

"""Config classes of the five sm90/sm100 kernels: validation, aliases, registration."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from backend_hw import cuda_capability

import moe_ep_sm90
import moe_ep_sm100
from moe_ep.contract import KernelConfig
from moe_ep.errors import MoeEpUsageError
from moe_ep.registry import available_kernels, get_kernel, parse_kernel_name, resolve_kernel_name

# (canonical kernel name, deprecated kernel alias, canonical config, alias config name, package)
KERNELS = [
    (
        "sm100_fp8_fp4_bf16_deepgemm",
        "deep_gemm_mega",
        moe_ep_sm100.Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig,
        "DeepGemmMegaMoeConfig",
        moe_ep_sm100,
    ),
    (
        "sm100_nvfp4_nvfp4_bf16_cutedsl",
        "nvfp4_cutedsl",
        moe_ep_sm100.Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig,
        "Nvfp4CutedslMegaMoeConfig",
        moe_ep_sm100,
    ),
    (
        "sm100_mxfp8_mxfp8_bf16_cutedsl",
        "mxfp8_cutedsl",
        moe_ep_sm100.Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig,
        "Mxfp8CutedslMegaMoeConfig",
        moe_ep_sm100,
    ),
    (
        "sm90_fp8_fp8_bf16_pull_cutedsl",
        "sm90_pull_fp8",
        moe_ep_sm90.Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig,
        "Sm90PullFp8MegaMoeConfig",
        moe_ep_sm90,
    ),
    (
        "sm90_fp8_fp8_bf16_push_cuda",
        "sm90_push_fp8",
        moe_ep_sm90.Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig,
        "Sm90PushFp8MegaMoeConfig",
        moe_ep_sm90,
    ),
]
IDS = [k[0] for k in KERNELS]
GOOD = dict(
    hidden_size=1024,
    intermediate_size=512,
    top_k=8,
    num_experts=16,
    world_size=2,
    max_tokens_per_rank=128,
)


@pytest.mark.parametrize(("name", "alias", "cfg", "alias_cfg", "pkg"), KERNELS, ids=IDS)
def test_config_is_frozen_keyword_only_taxonomy_class(name, alias, cfg, alias_cfg, pkg):
    assert issubclass(cfg, KernelConfig)
    assert cfg.kernel_name == name
    assert cfg.__name__ == parse_kernel_name(name).config_class_name
    config = cfg()
    assert all(f.kw_only for f in dataclasses.fields(cfg))
    first = dataclasses.fields(cfg)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(config, first, getattr(config, first))
    config.check_problem(**GOOD)


@pytest.mark.parametrize(("name", "alias", "cfg", "alias_cfg", "pkg"), KERNELS, ids=IDS)
def test_alias_config_class_warns_and_is_the_canonical_class(name, alias, cfg, alias_cfg, pkg):
    with pytest.warns(DeprecationWarning, match=cfg.__name__):
        got = getattr(pkg, alias_cfg)
    assert got is cfg
    assert alias_cfg not in pkg.__all__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(pkg, cfg.__name__) is cfg  # the canonical name never warns


@pytest.mark.parametrize(("name", "alias", "cfg", "alias_cfg", "pkg"), KERNELS, ids=IDS)
def test_kernel_alias_resolves_with_warning_and_config_finds_kernel(
    name, alias, cfg, alias_cfg, pkg
):
    with pytest.warns(DeprecationWarning, match=name):
        assert resolve_kernel_name(alias) == name
    kernel = get_kernel(cfg())
    assert kernel.kernel_name == name
    assert kernel.config_cls is cfg
    assert kernel.deprecated_aliases == (alias,)
    assert kernel.requirements.cuda


def _hardware_reason(name: str, cap: tuple[int, int] | None) -> str | None:
    """What every listing must say about `name` given cuda:0's capability `cap` (None: no
    CUDA device); None: no claim.

    No CUDA device: unavailable, naming that. A GPU of another arch: unavailable, naming
    the compute capability. The kernel's own arch: whether it runs depends on packages,
    drops and nvcc, so only an unavailable kernel's reason is checked (non-empty); the
    GPU check runs this module on an H200 too.
    """
    if cap is None:
        return "no CUDA device visible"
    needed = (9, 0) if name.startswith("sm90_") else (10, 0)
    return None if cap == needed else "compute capability"


def _check_listed(name: str, available: bool, reason: str, cap: tuple[int, int] | None) -> None:
    want = _hardware_reason(name, cap)
    if want is not None:
        assert available is False and want in reason, (name, available, reason)
    elif not available:
        assert reason, name
    else:
        assert reason == "", (name, reason)


def test_listing_has_the_five_names_unavailable_with_reasons_and_no_aliases():
    infos = {i.name: i for i in available_kernels()}
    for name, alias, *_ in KERNELS:
        assert name in infos
        assert alias not in infos
        _check_listed(name, infos[name].available, infos[name].reason, cuda_capability())
    # deepgemm also names its missing package (never installed here); all five have launch
    # paths (never run on a GPU), so none reports one missing.
    if "deep_gemm" not in sys.modules:
        assert "deep_gemm" in infos["sm100_fp8_fp4_bf16_deepgemm"].reason
    for name, *_ in KERNELS:
        assert "launch path" not in infos[name].reason


def test_listing_expectations_follow_the_hardware():
    # The expectations above, on each kind of machine (the GPU check runs them on an H200).
    for cap, sm90, sm100 in (
        (None, "no CUDA device visible", "no CUDA device visible"),
        ((9, 0), None, "compute capability"),
        ((10, 0), "compute capability", None),
        ((8, 0), "compute capability", "compute capability"),
    ):
        assert _hardware_reason("sm90_fp8_fp8_bf16_pull_cutedsl", cap) == sm90
        assert _hardware_reason("sm100_mxfp8_mxfp8_bf16_cutedsl", cap) == sm100
    hopper = (9, 0)
    _check_listed("sm90_fp8_fp8_bf16_pull_cutedsl", True, "", hopper)
    _check_listed("sm90_fp8_fp8_bf16_push_cuda", False, "nvcc is not on PATH", hopper)
    for name, available, reason in (
        ("sm100_nvfp4_nvfp4_bf16_cutedsl", True, ""),
        ("sm90_fp8_fp8_bf16_pull_cutedsl", False, ""),
        ("sm90_fp8_fp8_bf16_pull_cutedsl", True, "why not"),
    ):
        with pytest.raises(AssertionError):
            _check_listed(name, available, reason, hopper)
    with pytest.raises(AssertionError):
        _check_listed("sm90_fp8_fp8_bf16_pull_cutedsl", True, "", None)


def test_cli_kernels_json_lists_canonical_names_only():
    script = Path(sys.executable).parent / "moe-ep"
    # An interpreter whose console scripts live elsewhere (pip --user on the GPU machine)
    # runs the same entry point through -c.
    cmd = (
        [str(script)]
        if script.is_file()
        else [sys.executable, "-c", "import sys; from moe_ep.cli import main; sys.exit(main())"]
    )
    out = subprocess.run(
        [*cmd, "kernels", "--json"], capture_output=True, text=True, check=False, timeout=120
    )
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    for name, alias, *_ in KERNELS:
        _check_listed(name, rows[name]["available"], rows[name]["reason"], cuda_capability())
        assert alias not in rows


BAD_PULL = [
    ({"accum_mode": "3xacc"}, "accum_mode"),
    ({"gate_up_clamp": -1.0}, "gate_up_clamp"),
    ({"gate_up_clamp": float("inf")}, "gate_up_clamp"),
    ({"swap_ab": 1}, "swap_ab"),
    ({"mma_tiler_mnk": (128, 128, 128)}, "mma_tiler_mnk"),
    ({"mma_tiler_mnk": (64, 128, 96)}, "mma_tiler_mnk"),
    ({"swap_ab": True, "mma_tiler_mnk": (64, 128, 128)}, "mma_tiler_mnk"),
    ({"cluster_shape_mnk": (4, 1, 1)}, "cluster_shape_mnk"),
    ({"load_balance_mode": "dynamic"}, "load_balance_mode"),
    ({"max_active_clusters": 0}, "max_active_clusters"),
    ({"top_k": 0}, "top_k"),
]


@pytest.mark.parametrize(("kwargs", "field"), BAD_PULL)
def test_pull_config_rejects_bad_knobs_naming_the_field(kwargs, field):
    with pytest.raises(MoeEpUsageError, match=field):
        moe_ep_sm90.Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(**kwargs)


def test_pull_config_accepts_swap_ab_geometry_and_derives_launch_values():
    cfg = moe_ep_sm90.Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(
        swap_ab=True, mma_tiler_mnk=(128, 32, 128), cluster_shape_mnk=(1, 2, 1)
    )
    assert cfg.token_padding_block == 32  # tokens sit on N when A/B are swapped
    assert cfg.resolved_max_active_clusters == 132 // 2
    native = moe_ep_sm90.Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig()
    assert native.token_padding_block == 64
    assert native.resolved_max_active_clusters == 132


BAD_PROBLEMS = [
    ({"hidden_size": 1000}, "hidden_size"),
    ({"intermediate_size": 200}, "intermediate_size"),
    ({"num_experts": 15}, "num_experts"),
    ({"top_k": 17, "num_experts": 16}, "top_k"),
    ({"max_tokens_per_rank": 0}, "max_tokens_per_rank"),
]


@pytest.mark.parametrize(("name", "alias", "cfg", "alias_cfg", "pkg"), KERNELS, ids=IDS)
@pytest.mark.parametrize(("change", "field"), BAD_PROBLEMS)
def test_check_problem_rejects_unsupported_geometry(
    name, alias, cfg, alias_cfg, pkg, change, field
):
    with pytest.raises(MoeEpUsageError, match=field):
        cfg().check_problem(**{**GOOD, **change})


def test_shape_multiples_differ_per_kernel():
    # 64-multiples are the CuTe DSL sm100 drop's rule; fp8 blockwise needs 128; DeepGEMM's
    # mega-MoE needs 512.
    ok_64 = {**GOOD, "hidden_size": 64 * 17, "intermediate_size": 64 * 9}
    moe_ep_sm100.Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig().check_problem(**ok_64)
    moe_ep_sm100.Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig().check_problem(**ok_64)
    for cfg in (
        moe_ep_sm90.Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(),
        moe_ep_sm90.Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig(),
    ):
        with pytest.raises(MoeEpUsageError, match="multiple of 128"):
            cfg.check_problem(**ok_64)
    deepgemm = moe_ep_sm100.Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig()
    for bad in ({"hidden_size": 128 * 5}, {"intermediate_size": 128 * 3}):
        with pytest.raises(MoeEpUsageError, match="multiple of 512"):
            deepgemm.check_problem(**{**GOOD, **bad})
    deepgemm.check_problem(**{**GOOD, "hidden_size": 512 * 3, "intermediate_size": 512})


def test_push_top_k_limit_and_config_top_k_mismatch():
    push = moe_ep_sm90.Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig()
    push.check_problem(**GOOD)
    with pytest.raises(MoeEpUsageError, match="top_k must be <= 8"):
        push.check_problem(**{**GOOD, "top_k": 9})
    pull = moe_ep_sm90.Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(top_k=4)
    with pytest.raises(MoeEpUsageError, match="top_k"):
        pull.check_problem(**GOOD)


def test_nvfp4_norm_const_validated():
    cfg = moe_ep_sm100.Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig
    with pytest.raises(MoeEpUsageError, match="input_norm_const"):
        cfg(input_norm_const=0.0)
    assert cfg(input_norm_const=2.5).input_norm_const == 2.5

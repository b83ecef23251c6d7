"""`sm90_fp8_fp8_bf16_pull_cutedsl` (alias `sm90_pull_fp8`): Hopper pull-style CuTe DSL
mega-MoE, fp8 blockwise; peers pull tokens over NVLink from symmetric memory.

Upstream bytes: the `sm90_pull_cutedsl` drop, `vendor/sm90_pull_cutedsl/src/moe_hopper_fp8/`
(`Sm90MegaMoEFp8Kernel` / `Sm90MegaMoESwapABFp8Kernel`), loaded in `upstream`.

- `config`: `Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig`.
- `kernel`: `Sm90Fp8Fp8Bf16PullCutedslKernel` (core's CuTe DSL base plus the drop's hooks).
- `layout`: weight preparation (bf16 weights or a fitting pre-quantized pack), input staging.
- `args`: the drop kernel's tensor arguments and constructor (`tensor_specs`, `build_kernel`;
  the call arguments are `common.pull_args.pull_call_args` of them).
- `compile`: the compile-only check (`python -m moe_ep_sm90.compile_check pull`).
- `upstream`: the drop reference and its kernel classes.
"""

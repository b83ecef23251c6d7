"""`sm90_bf16_bf16_bf16_pull_cutedsl`: Hopper pull-style CuTe DSL mega-MoE, bf16 activations
and weights, bf16 combine; peers pull tokens over NVLink from symmetric memory.

Upstream bytes: the `sm90_pull_cutedsl` drop, `vendor/sm90_pull_cutedsl/src/moe_hopper_bf16/`
(`Sm90MegaMoEBf16Kernel` / `Sm90MegaMoESwapABBf16Kernel`, new in flashinfer-python 0.7.4),
loaded in `upstream`. Never run on a GPU (see `kernel`).

- `config`: `Sm90_Bf16_Bf16_Bf16_PullCutedsl_MegaMoeConfig`.
- `kernel`: `Sm90Bf16Bf16Bf16PullCutedslKernel` (core's CuTe DSL base plus the drop's hooks).
- `layout`: weight preparation from bf16/fp32 weights, input staging.
- `args`: the drop kernel's tensor arguments and constructor (`tensor_specs`, `build_kernel`;
  the call arguments are `common.pull_args.pull_call_args` of them).
- `compile`: the compile-only check (`python -m moe_ep_sm90.compile_check bf16-pull`).
- `upstream`: the drop's bf16 kernel classes.

What both pull kernels share is in `moe_ep_sm90.common` (`pull_tiles`, `pull_args`,
`pull_drop`).
"""

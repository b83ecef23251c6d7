"""`sm100_nvfp4_nvfp4_bf16_cutedsl` (alias `nvfp4_cutedsl`): Blackwell CuTe DSL mega-MoE,
nvfp4 activations and weights (swap-AB), NVSHMEM peers.

Upstream bytes: the `sm100_cutedsl_megamoe` drop,
`vendor/sm100_cutedsl_megamoe/src/moe_nvfp4_swapab/` (`Sm100MegaMoEKernel`), loaded in
`upstream`.

- `config`: `Sm100_Nvfp4_Nvfp4_Bf16_Cutedsl_MegaMoeConfig`.
- `kernel`: `Sm100Nvfp4Nvfp4Bf16CutedslKernel` (`common.cutedsl.Sm100CutedslKernel`).
- `layout`: weight preparation and input staging.
- `args`: the drop kernel's constructor and call arguments (`build_kernel`, `call_args`).
- `compile`: the compile-only check (`python -m moe_ep_sm100.compile_check nvfp4`).
- `upstream`: the drop kernel class and ABI constants.
"""

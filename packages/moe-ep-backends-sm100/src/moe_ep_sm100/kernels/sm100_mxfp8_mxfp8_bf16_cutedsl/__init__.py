"""`sm100_mxfp8_mxfp8_bf16_cutedsl` (alias `mxfp8_cutedsl`): Blackwell CuTe DSL mega-MoE
(2-CTA), mxfp8 e4m3 with E8M0 block scales, NVSHMEM peers.

Upstream bytes: the `sm100_cutedsl_megamoe` drop,
`vendor/sm100_cutedsl_megamoe/src/moe_mxfp8_glu/` (`Sm100MegaMoEMxfp8Kernel`), loaded in
`upstream`.

- `config`: `Sm100_Mxfp8_Mxfp8_Bf16_Cutedsl_MegaMoeConfig`.
- `kernel`: `Sm100Mxfp8Mxfp8Bf16CutedslKernel` (`common.cutedsl.Sm100CutedslKernel`).
- `layout`: weight preparation and input staging.
- `args`: the drop kernel's constructor and call arguments (`build_kernel`, `call_args`).
- `compile`: the compile-only check (`python -m moe_ep_sm100.compile_check mxfp8`).
- `upstream`: the drop kernel class and ABI constants.
"""

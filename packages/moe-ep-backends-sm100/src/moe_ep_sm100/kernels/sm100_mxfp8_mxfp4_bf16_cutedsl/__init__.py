"""`sm100_mxfp8_mxfp4_bf16_cutedsl`: Blackwell CuTe DSL mega-MoE, mxfp4 (e2m1) weights x
mxfp8 (e4m3) activations with E8M0 block scales, bf16 combine, NVSHMEM peers.

Upstream bytes: the `sm100_next_cutedsl_megamoe` drop,
`vendor/sm100_next_cutedsl_megamoe/src/sources/` (`BlackwellInferenceMegaMoE`, quantization
kind `mxfp4_mxfp8`), loaded in `upstream`. FlashInfer 0.7.4 has no deprecated alias for it.

- `config`: `Sm100_Mxfp8_Mxfp4_Bf16_Cutedsl_MegaMoeConfig`.
- `kernel`: `Sm100Mxfp8Mxfp4Bf16CutedslKernel` (`common.cutedsl.Sm100CutedslKernel`).
- `layout`: weight preparation and input staging.
- `args`: the drop kernel's descriptors and call arguments (`build_kernel`, `call_args`).
- `compile`: the compile-only check (`python -m moe_ep_sm100.compile_check mxfp8_mxfp4`).
- `upstream`: the drop kernel class, its descriptor types, the constants checked against it.
"""

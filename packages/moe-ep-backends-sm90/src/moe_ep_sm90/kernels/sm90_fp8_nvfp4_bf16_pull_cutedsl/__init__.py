"""`sm90_fp8_nvfp4_bf16_pull_cutedsl`: Hopper pull-style CuTe DSL mega-MoE, e4m3 activations
(one fp32 scale per token, `mxfp4_hybrid`) x nvfp4 weights (e4m3 scale per 16, fp32 decode
scale per expert).

Upstream bytes: FlashInfer's `Sm90MegaMoESwapABNvfp4Fp8Kernel`, the `sm90_pull_nvfp4` drop
(`vendor/sm90_pull_nvfp4/src/shim/nvfp4_{kernels,conversion,policy}.py`), over the
`sm90_pull_cutedsl` drop's MXFP4 kernel (`vendor/sm90_pull_cutedsl/src/moe_hopper_fp8/`).

- `config`: `Sm90_Fp8_Nvfp4_Bf16_PullCutedsl_MegaMoeConfig` (the MXFP4 config's fixed
  contract and rules, plus `nvfp4_kperm` and `nvfp4_fc1_k256_overlap`).
- `kernel`: `Sm90Fp8Nvfp4Bf16PullCutedslKernel`, the MXFP4 wrapper's class with the NVFP4
  weights, staging, drops and knobs.
- `layout`: the weights' logical ABI (K permutation, gate/up by 8, scale pairs, 64 x 128
  scale folds, `8 * G`) from bf16 weights (the portable twin's quantizer) or a pre-quantized
  nvfp4 pack, the physical tiles (`common.tile_fold`, the MXFP4 kernel's), input staging.
- `args`: the drop kernel's constructor arguments and tensor ABI (`build_kernel`,
  `tensor_specs`; the MXFP4 kernel's with the NVFP4 scale planes and knobs).
- `compile`: the compile-only check (`python -m moe_ep_sm90.compile_check nvfp4-pull`).
- `upstream`: both drops, loaded in order; the kernel class, its conversion layout, the
  availability (`nvfp4_availability`).

Nothing here has run on a GPU.
"""

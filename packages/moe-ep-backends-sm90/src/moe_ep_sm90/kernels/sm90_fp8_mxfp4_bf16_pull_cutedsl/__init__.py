"""`sm90_fp8_mxfp4_bf16_pull_cutedsl` (no deprecated alias upstream): Hopper pull-style CuTe
DSL mega-MoE, e4m3 activations x mxfp4 weights, `fp8_scale_mode="mxfp4_hybrid"`.

Upstream bytes: the `sm90_pull_cutedsl` drop, `vendor/sm90_pull_cutedsl/src/moe_hopper_fp8/`
(`Sm90MegaMoESwapABMxfp4Fp8Kernel`, `kernel_mxfp4_fp8_glu_fc12_swapab.py`, `mxfp4_cutedsl.py`).

- `config`: `Sm90_Fp8_Mxfp4_Bf16_PullCutedsl_MegaMoeConfig` (the fixed contract refused
  otherwise with `MoeEpUsageError`, H and I multiples of 128, upstream's gate/up clamp 10.0).
- `kernel`: `Sm90Fp8Mxfp4Bf16PullCutedslKernel` (the sm90 pull base plus this format's
  weights, staging and tensor arguments).
- `layout`: the kernel's logical weight ABI (gate/up-interleaved e2m1 codes, 4-bit exponent
  offsets, per-expert residual) from bf16 weights or a pre-quantized mxfp4 pack, and the
  legs as the kernel takes them; input staging (e4m3 with the per-token scale on a 16-byte
  row).
- `args`: the drop kernel's constructor arguments and tensor ABI (`build_kernel`, `tensor_specs`).
- `compile`: the compile-only check (`python -m moe_ep_sm90.compile_check mxfp4-pull`).
- `upstream`: the drop's kernel class and ABI constants.

Nothing here has run on a GPU.
"""

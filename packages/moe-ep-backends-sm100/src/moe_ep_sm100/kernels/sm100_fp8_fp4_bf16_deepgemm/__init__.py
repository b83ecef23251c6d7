"""`sm100_fp8_fp4_bf16_deepgemm` (alias `deep_gemm_mega`): DeepGEMM's Blackwell fp8 x fp4
mega-MoE, through the `deep_gemm` package.

Upstream bytes: none vendored; the `deep_gemm` package (github.com/deepseek-ai/DeepGEMM),
whose API slice the wrapper is written against is in `upstream`.

- `config`: `Sm100_Fp8_Fp4_Bf16_Deepgemm_MegaMoeConfig`.
- `kernel`: `Sm100Fp8Fp4Bf16DeepgemmKernel`.
- `layout`: weight preparation and input staging in DeepGEMM's layouts.
- `upstream`: loading `deep_gemm`, its availability and the API check.
"""

"""`sm90_fp8_fp8_bf16_push_cuda` (alias `sm90_push_fp8`): Hopper push-style CUDA mega-MoE,
fp8 blockwise; senders write tokens into peers' buffers (torch symmetric memory).

Upstream bytes: the `sm90_push_cuda` drop, `vendor/sm90_push_cuda/src/` (`a2a`,
`fp8_gemm`), with headers from `vendor/sm90_push_cuda_deps/src/` (`upstream`).

- `config`: `Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig`.
- `kernel`: `Sm90Fp8Fp8Bf16PushCudaKernel`.
- `layout`: weight preparation and input staging.
- `build`: nvcc build and TVM-FFI load of the drop's two modules.
- `peers`: the peer checks all ranks agree on; `window`: the symmetric window's layout;
  `pipe`: one pipe (window, scratch, GEMM resources, a protocol round).
- `compile`: the compile-only check (`python -m moe_ep_sm90.compile_check push-a2a`).
- `upstream`: the two drop references.
"""

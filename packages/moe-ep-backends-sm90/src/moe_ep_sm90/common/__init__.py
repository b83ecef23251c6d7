"""What the sm90 kernels share: the fp8 blockwise config rules (`config`), weight record,
quantizer and staged-input record (`fp8_blockwise`), the weight-pack check with its
pre-quantized-pack rules (`fp8_packs`), the compile-only checks' `CompileResult`, and what
the pull kernels (fp8, bf16; one drop) share: their launch-geometry knobs (`pull_tiles`),
their common constructor and call arguments (`pull_args`), the drop, its availability and
combine region (`pull_drop`), their kernel base class (`pull_kernel`) and compile-only
check (`pull_compile`); and the MXFP4 / NVFP4 pull kernels' physical weight tiles (`tile_fold`)."""

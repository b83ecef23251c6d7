"""What the two sm90 kernels share: the fp8 blockwise config rules (`config`), weight record,
quantizer and staged-input record (`fp8_blockwise`), the weight-pack check with its
pre-quantized-pack rules (`fp8_packs`) and the compile-only checks' `CompileResult`."""

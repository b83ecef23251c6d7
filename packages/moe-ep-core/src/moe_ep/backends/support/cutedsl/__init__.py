"""CuTe DSL machinery: the mega-kernel lifecycle the CuTe DSL kernels subclass
(`mega_kernel.CutedslMegaKernel`), its launch pieces (`launch_glue`: peer offsets, workspace
regions, streams) and the compile-only check's fake tensors (`compile_fakes`)."""

"""One subpackage per sm100 kernel, named by its taxonomy name (`moe-ep kernels`)."""

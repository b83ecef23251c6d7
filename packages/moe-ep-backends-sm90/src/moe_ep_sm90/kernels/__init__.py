"""One subpackage per sm90 kernel, named by its taxonomy name (`moe-ep kernels`)."""

"""Pooling of compiled kernels and workspaces across layers of one geometry:
`workspace_pool.WorkspacePool` (ref-counted entries) and `pooled_kernel.PooledKernel`
(the compile-once kernel lifecycle built on it)."""

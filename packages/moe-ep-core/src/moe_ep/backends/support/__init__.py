"""Machinery shared by the GPU backend packages (`moe_ep_sm90`, `moe_ep_sm100`), by subject.

- `availability`: why a kernel can or cannot run here (GPU arch, packages, nvcc, drops).
- `drop_access`: `DropRef` (a drop reached through its package `__init__`) and loading a
  module of a drop's `src/` through its shim.
- `launch_args`: `LaunchGeometry`, `ArgSpec`, the CuTe DSL call arguments, geometry checks.
- `config_checks`: config validators and `GeometryCheckedConfig`.
- `package_attrs`: a backend package's lazy `__getattr__` / `__dir__`.
- `staging`: the stagers' input checks and routing buffers.
- `pooling`: the ref-counted `WorkspacePool` and the pooled compile-once `PooledKernel`.
- `cutedsl`: the CuTe DSL mega-kernel lifecycle (`mega_kernel`), its launch pieces
  (`launch_glue`) and the compile-only check's fakes (`compile_fakes`).

Nothing here names a backend or drop package; a backend passes its own drops, kernels and
constants in. Importing any module here is light: torch, cutlass and nvshmem are imported
inside the functions that need them.
"""

"""Machinery shared by the GPU backend packages (`moe_ep_sm90`, `moe_ep_sm100`).

Generic pieces only: availability probes (`hardware`), the ref-counted workspace pool
(`pool`), loading a drop's module through its shim (`drops`), the pooled compile-once kernel
lifecycle (`pooled`), config validators (`configs`) and compile-only check helpers
(`compile_check`). Nothing here names a backend or drop package; a backend passes its own
drops, kernels and constants in. Importing any module here is light: torch, cutlass and
nvshmem are imported inside the functions that need them.
"""

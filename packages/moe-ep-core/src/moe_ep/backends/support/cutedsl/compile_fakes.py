"""Helpers of the compile-only checks (no GPU): the arch guard, fake tensors, fake peers.

A compile-only check builds a kernel from its args module with fake global-memory tensors
and compiles it for an arch-specific target; the CuTe DSL reads that target from
`CUTE_DSL_ARCH` when cutlass is imported, so the check runs in a fresh process. cutlass is
imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from moe_ep import env
from moe_ep.backends.support.cutedsl.kernel_cache import compile_cached
from moe_ep.backends.support.launch_args import ArgSpec, LaunchGeometry

__all__ = [
    "DEFAULT_CHECK_GEOMETRY",
    "FAKE_ADDRESS",
    "fake_call_inputs",
    "fake_gmem_tensor",
    "fake_peer_map",
    "fake_pointer",
    "require_cute_dsl_arch",
    "timed_compile",
]

# One default shape: 2 ranks, 8 experts (4 local), H=1024, I=512, top-8, 128 tokens per rank.
DEFAULT_CHECK_GEOMETRY = LaunchGeometry(
    world_size=2,
    rank=0,
    max_tokens_per_rank=128,
    top_k=8,
    num_experts=8,
    hidden_size=1024,
    intermediate_size=512,
)

FAKE_ADDRESS = 1 << 20
"""Any 16-byte aligned address: a compile never dereferences it."""


def require_cute_dsl_arch(arch: str) -> None:
    """`RuntimeError` unless `CUTE_DSL_ARCH` already equals `arch` (read at cutlass import)."""
    current = env.cute_dsl_arch()
    if current != arch:
        raise RuntimeError(
            f"CUTE_DSL_ARCH must be {arch!r} before cutlass is imported, got {current!r}"
        )


def fake_gmem_tensor(spec: ArgSpec, dtype: Any) -> Any:
    """Fake gmem tensor of cutlass `dtype` for `spec`: dynamic 32-bit extents and 64-bit
    strides, stride 1 on the leading dim: exactly what `from_dlpack` + `mark_layout_dynamic`
    give the launch path (`(?,?):(?{i64},1)`), so the compile check builds the same kernel."""
    import cutlass.cute as cute
    from cutlass.cute.typing import AddressSpace

    shape = tuple(cute.sym_int32() for _ in spec.shape)
    stride = tuple(1 if d == spec.leading_dim else cute.sym_int64() for d in range(len(spec.shape)))
    return cute.runtime.make_fake_tensor(
        dtype,
        shape,
        stride=stride,
        memspace=AddressSpace.gmem,
        assumed_align=spec.align,
    )


def fake_pointer(name: str) -> Any:
    """A 16-byte aligned gmem `Uint8` pointer at `FAKE_ADDRESS` (workspace `name` unused)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.typing import AddressSpace

    return cute.runtime.make_ptr(cutlass.Uint8, FAKE_ADDRESS, AddressSpace.gmem, assumed_align=16)


def fake_peer_map(sym_buffer_host: type, g: LaunchGeometry) -> Any:
    """The drop's `SymBufferHost` with made-up, distinct per-rank offsets."""
    return sym_buffer_host(
        base_addr=1 << 30,
        offsets=tuple(r << 32 for r in range(g.world_size)),
        rank_idx=g.rank,
        num_max_ranks=g.world_size,
    )


def fake_call_inputs(
    tensor: Any, sym_buffer_host: type, g: LaunchGeometry, max_active_clusters: int
) -> dict[str, Any]:
    """The `call_args` inputs every compile-only check passes alike: its fake-tensor builder
    `tensor`, `fake_peer_map`, stream 0 and `max_active_clusters`."""
    import cuda.bindings.driver as cuda

    return dict(
        tensor=tensor,
        peer_map=fake_peer_map(sym_buffer_host, g),
        stream=cuda.CUstream(0),
        max_active_clusters=max_active_clusters,
    )


def timed_compile(
    kernel: Any, args: dict[str, Any], arch: str, *, config: Any, geometry: LaunchGeometry
) -> tuple[Any, float]:
    """`cute.compile(kernel, **args)` for `arch` (`config`, `geometry`: what built it), through
    the kernel cache when `MOE_EP_CUTEDSL_CACHE` is set (`kernel_cache`); (compiled, seconds).
    """
    compiled, _, seconds = compile_cached(kernel, args, config=config, geometry=geometry, arch=arch)
    return compiled, seconds

"""Launch geometry and tensor-argument specs shared by the GPU backends' args modules.

An args module (`pull_args`, `nvfp4_args`, `mxfp8_args`) describes a kernel's tensor
arguments as `ArgSpec`s computed from a `LaunchGeometry`; the compile-only check builds fake
tensors from them and the launch path real ones, so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # moe_ep.checks imports torch: keep this module light
    from moe_ep.checks import PackShape

__all__ = [
    "ArgSpec",
    "LaunchGeometry",
    "ceil_to",
    "check_config_geometry",
    "check_pack_geometry",
    "kernel_call_args",
]


def ceil_to(v: int, m: int) -> int:
    """`v` rounded up to a multiple of `m`."""
    return -(-v // m) * m


@dataclass(frozen=True)
class LaunchGeometry:
    """One layer's launch geometry on one rank (everything the compiled kernel depends on).

    `top_k` is 0 while unknown (no `config.top_k` and no inputs staged yet).
    """

    world_size: int
    rank: int
    max_tokens_per_rank: int
    top_k: int
    num_experts: int
    hidden_size: int
    intermediate_size: int

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size


@dataclass(frozen=True)
class ArgSpec:
    """One tensor argument of a kernel's `__call__`, in LOGICAL elements.

    `dtype`: a name from the args module's vocabulary (torch dtype names for sm90; "fp4"
    (e2m1, counted in elements, not packed bytes), "fp8_e4m3", "e8m0", ... for sm100);
    `leading_dim`: the stride-1 mode; `align`: the assumed byte alignment.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    leading_dim: int
    align: int = 16


def check_config_geometry(config: Any, g: LaunchGeometry) -> None:
    """`config.check_problem(...)` with the fields of `g` (`MoeEpUsageError` if it cannot run)."""
    config.check_problem(
        hidden_size=g.hidden_size,
        intermediate_size=g.intermediate_size,
        top_k=g.top_k,
        num_experts=g.num_experts,
        world_size=g.world_size,
        max_tokens_per_rank=g.max_tokens_per_rank,
    )


def check_pack_geometry(config: Any, fleet: Any, world_size: int, shape: PackShape) -> None:
    """`config.check_problem` for a checked weight pack's H and I before any collective
    (top_k from the config, else 1)."""
    config.check_problem(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        top_k=getattr(config, "top_k", None) or 1,
        num_experts=fleet.num_experts,
        world_size=world_size,
        max_tokens_per_rank=fleet.max_tokens_per_rank,
    )


def kernel_call_args(
    specs: Iterable[ArgSpec],
    tensor: Callable[[ArgSpec], Any],
    *,
    workspaces: tuple[Any, Any],
    peer_map: Any,
    stream: Any,
    max_active_clusters: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of a CuTe DSL mega-MoE kernel's `__call__` (and `cute.compile`):
    `tensor(spec)` for every spec, then `extra`, the (local, shared) workspaces, the drop's
    `SymBufferHost` peer map, the stream and max active clusters."""
    args: dict[str, Any] = {spec.name: tensor(spec) for spec in specs}
    args.update(extra or {})
    args["local_workspace"], args["shared_workspace"] = workspaces
    args["peer_rank_ptr_mapper_host"] = peer_map
    args["stream"] = stream
    args["max_active_clusters"] = max_active_clusters
    return args

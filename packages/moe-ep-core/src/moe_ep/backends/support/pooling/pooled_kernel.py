"""Lifecycle of a pooled, compile-once GPU kernel: geometry, pool entry, warmup, destroy.

Layers of one (kernel, config, geometry, device) share one compiled kernel and its
workspaces through a `WorkspacePool`; `top_k` is part of the compiled kernel, taken from the
config or else from the first staged inputs. A subclass sets `pool` (its module's pool)
and implements `_compile(geometry)` plus `stage_inputs` / `compute_staged`.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from moe_ep.backends.support.cutedsl.kernel_cache import compile_cached
from moe_ep.backends.support.launch_args import LaunchGeometry, check_config_geometry
from moe_ep.backends.support.pooling.workspace_pool import WorkspacePool
from moe_ep.contract import MegaKernel, validated_shape
from moe_ep.errors import MoeEpUnavailableError, MoeEpUsageError

if TYPE_CHECKING:
    import torch

    from moe_ep.checks import PackShape
    from moe_ep.runtime import Runtime
    from moe_ep.types import FleetParams, MoEWeightPack


__all__ = [
    "KernelCacheUse",
    "PooledKernel",
    "StagedCall",
    "compile_collective",
    "require_config",
]


def require_config(config: Any, config_cls: type) -> None:
    """`MoeEpUsageError` unless `config` is a `config_cls`."""
    if not isinstance(config, config_cls):
        raise MoeEpUsageError(
            f"config must be a {config_cls.__name__}, got {type(config).__name__}"
        )


def compile_collective(
    kernel: Any,
    args: dict[str, Any],
    runtime: Any,
    *,
    per_layer: tuple[str, ...] = (),
    cache: KernelCacheUse | None = None,
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """`cute.compile(kernel, **args)`, or, with `cache`, this rank's kernel-cache entry
    (loaded, else compiled for `cache.arch` and stored), then wait for the device and for
    every rank (so every rank's symmetric buffers are zeroed before any launch). Collective;
    GPU only (never run on one; a loaded kernel has never been launched).

    Returns (compiled, the pooled launch arguments, the compiling layer's own ones): the
    pooled ones are `args` without `max_active_clusters`, `stream` (each launch passes the
    stream current then) and the `per_layer` names (each layer passes its own weights, so the
    pooled entry holds no layer's tensors).
    """
    import cutlass.cute as cute
    import torch

    if cache is None:
        compiled = cute.compile(kernel, **args)
    else:
        compiled, _, _ = compile_cached(
            kernel,
            args,
            config=cache.config,
            geometry=cache.geometry,
            arch=cache.arch,
            root=cache.root,
        )
    dropped = {"max_active_clusters", "stream", *per_layer}
    launch_args = {k: v for k, v in args.items() if k not in dropped}
    torch.cuda.synchronize(runtime.device)
    runtime.barrier()
    return compiled, launch_args, {name: args[name] for name in per_layer}


@dataclass(frozen=True)
class KernelCacheUse:
    """What `compile_collective` keys a kernel-cache entry by, and where the cache is."""

    root: Path
    config: Any
    geometry: LaunchGeometry
    arch: str


@dataclass
class StagedCall:
    """What `stage_inputs` hands to `compute_staged`: the staged inputs (with `num_tokens`,
    the live rows) and the layer's output."""

    inputs: Any
    output: torch.Tensor


class PooledKernel(MegaKernel):
    """Base of the compile-once kernels: pooled entry, `warmup`, idempotent `destroy`.

    Construction: the config's type is checked, then the class's `validate_weights` (pack,
    geometry and refused knobs; skipped when the caller ran it for this construction, see
    `moe_ep.contract.caller_validated_weights`), then `_prepare_weights` (kernel-ready
    weights on the runtime's device, in `self.prepared`). Subclasses set `pool` and
    implement `validate_weights`, `_prepare_weights` and `_compile`. `build_verb` names
    what the first use does ("compile", "build") in the error raised while `top_k` is
    still unknown.
    """

    pool: ClassVar[WorkspacePool[Any]]
    build_verb: ClassVar[str] = "compile"
    cfg: Any

    def __init__(
        self,
        *,
        config: Any,
        fleet: FleetParams,
        runtime: Runtime,
        weights: MoEWeightPack,
    ) -> None:
        require_config(config, self.config_cls)
        shape = validated_shape(weights, fleet, runtime.world_size, config)
        if shape is None:
            shape = self.validate_weights(weights, fleet, runtime.world_size, config)
        super().__init__(config=config, fleet=fleet, runtime=runtime, weights=weights)
        self.cfg = config
        self.prepared = self._prepare_weights(weights, runtime.device)
        # top_k is part of the compiled kernel; from the config, else from the first inputs.
        self.geometry = LaunchGeometry(
            world_size=runtime.world_size,
            rank=runtime.rank,
            max_tokens_per_rank=fleet.max_tokens_per_rank,
            top_k=getattr(config, "top_k", None) or 0,
            num_experts=fleet.num_experts,
            hidden_size=fleet.hidden_size,
            intermediate_size=shape.intermediate_size,
        )
        self._pool_key: tuple[Any, ...] | None = None
        self._pooled: Any = None
        self._destroyed = False
        self._weight_args: dict[str, Any] | None = None

    # -- subclass hooks -----------------------------------------------------------------
    @classmethod
    @abstractmethod
    def validate_weights(
        cls, weights: MoEWeightPack, fleet: FleetParams, world_size: int, config: Any
    ) -> PackShape:
        """Local checks before any collective: the pack's shapes and dtypes against this
        kernel's recipe, the geometry against the config, knobs the kernel cannot honour."""

    @abstractmethod
    def _prepare_weights(self, weights: MoEWeightPack, device: torch.device) -> Any:
        """Kernel-ready weights on `device` (kept in `self.prepared`)."""

    @abstractmethod
    def _compile(self, g: LaunchGeometry) -> Any:
        """The pool entry for geometry `g` (compile, allocate; collective; GPU only)."""

    def _build_weight_args(self) -> dict[str, Any]:
        """This layer's own weight arguments of the launch, by name (default: none; the
        CuTe DSL kernels convert their prepared weights as their compile does)."""
        return {}

    # -- lifecycle ----------------------------------------------------------------------
    def warmup(self) -> None:
        """Collective: compile (first layer of this geometry) and allocate the workspaces.

        Needs `config.top_k`; without it this happens at the first forward.
        """
        if self.geometry.top_k:
            self._ensure_geometry(self.geometry.top_k)
            self._entry()
        self.runtime.barrier()

    def destroy(self) -> None:
        """Collective, idempotent: drop this layer's reference to the pooled entry.

        The last layer of a geometry frees the entry (symmetric buffers: a collective), so
        every rank must call it; `__del__` is not relied on because garbage collection order
        differs between ranks.
        """
        if self._destroyed:
            return
        self._destroyed = True
        if self._pool_key is not None:
            self._wait_device()
            self.runtime.barrier()
            self.pool.release(self._pool_key)
            self._pool_key = None
            self._pooled = None

    # -- internals ----------------------------------------------------------------------
    def _wait_device(self) -> None:
        """Block until this rank's device work is done (CUDA runtimes). `destroy` waits
        before its barrier, as the drops' runners do (synchronize, barrier, free): a host
        barrier alone lets a rank free symmetric memory a peer's kernel still uses."""
        if self.runtime.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.runtime.device)

    def _hold_staging(self, entry: Any, call: StagedCall) -> StagedCall:
        """Record `call` as the owner of `entry`'s staging buffers (`stage_inputs`)."""
        entry.staged_by = call
        return call

    def _take_staging(self, entry: Any, staged: StagedCall) -> None:
        """`compute_staged`'s check: `staged` must still own the staging buffers, which
        every layer sharing the pooled entry overwrites; `MoeEpUsageError` otherwise."""
        if getattr(entry, "staged_by", None) is not staged:
            raise MoeEpUsageError(
                "staged inputs were overwritten: layers of one geometry share their staging "
                "buffers, so call compute_staged for a layer before stage_inputs of the next "
                "(and compute each staged handle once)"
            )
        entry.staged_by = None

    def _launch_args(self, entry: Any) -> dict[str, Any]:
        """The pooled compile's launch arguments with this layer's own weights (built once
        per layer) and the stream current now. Layers sharing a pooled entry share its
        compiled kernel and buffers, never its weights. GPU only."""
        from moe_ep.backends.support.cutedsl.launch_glue import current_stream

        if self._weight_args is None:
            self._weight_args = self._build_weight_args()
        return {
            **entry.launch_args,
            **self._weight_args,
            "stream": current_stream(self.runtime.device),
        }

    def _ensure_geometry(self, top_k: int) -> LaunchGeometry:
        """The geometry with `top_k` fixed (first inputs fix it), checked by the config."""
        g = self.geometry
        if g.top_k == 0:
            g = replace(g, top_k=top_k)
            self.geometry = g
        elif top_k != g.top_k:
            raise MoeEpUsageError(
                f"topk_ids has k={top_k} columns but this kernel was built for top_k={g.top_k}"
            )
        check_config_geometry(self.cfg, g)
        return g

    def _entry(self) -> Any:
        """This layer's pooled entry; compiles on first use of its geometry."""
        if self._destroyed:
            raise MoeEpUsageError("this kernel was destroyed; build a new layer")
        if self._pooled is not None:
            return self._pooled
        ok, why = self.availability()
        if not ok:
            raise MoeEpUnavailableError(f"{self.kernel_name} cannot run here: {why}")
        g = self.geometry
        if g.top_k == 0:
            raise MoeEpUsageError(
                f"top_k is unknown: set the config's top_k to {self.build_verb} in warmup(), "
                "or stage inputs first"
            )
        key = (self.kernel_name, self.cfg, g, str(self.runtime.device))
        self._pooled = self.pool.acquire(key, lambda: self._compile(g))
        self._pool_key = key
        return self._pooled

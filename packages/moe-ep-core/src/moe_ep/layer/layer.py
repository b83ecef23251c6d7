"""`MoEEpLayer`: the user-facing expert-parallel MoE layer."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from moe_ep.checks import (
    check_forward_values,
    check_live_tensor,
    live_token_count,
    validate_forward,
)
from moe_ep.compat.flashinfer import layer_backend
from moe_ep.config import BootstrapConfig
from moe_ep.contract import KernelConfig, MegaKernel, caller_validated_weights
from moe_ep.device import resolve_local_device
from moe_ep.errors import MoeEpPeerError, MoeEpUnavailableError, MoeEpUsageError
from moe_ep.layer.agreement import agree, agree_on_setup, setup_fingerprint
from moe_ep.layer.eviction import check_eviction, check_mode, rebuild_group, survivor_placement
from moe_ep.layer.weight_moves import move_weights
from moe_ep.placement import Placement
from moe_ep.placement_routing import expert_pair_counts
from moe_ep.placement_weights import transfer_sources
from moe_ep.tuning.lookup import layer_config
from moe_ep.types import FleetParams, MoEEpTensors, MoEWeightPack

__all__ = ["MoEEpLayer", "StagedForward", "resolve_backend"]


def resolve_backend(backend: str | KernelConfig) -> tuple[type[MegaKernel], KernelConfig]:
    """(kernel class, config) for a kernel name (default config) or a config object."""
    from moe_ep.registry import get_kernel

    if not isinstance(backend, str | KernelConfig):
        raise MoeEpUsageError(
            f"backend must be a kernel name (e.g. 'any_bf16_bf16_bf16_torch') or a kernel "
            f"config object, got {type(backend).__name__}"
        )
    kernel_cls: type[MegaKernel] = get_kernel(backend)
    if isinstance(backend, str):
        return kernel_cls, kernel_cls.config_cls()
    if not isinstance(backend, kernel_cls.config_cls):
        raise MoeEpUsageError(
            f"backend config {type(backend).__name__} names kernel {backend.kernel_name!r}, "
            f"whose config class is {kernel_cls.config_cls.__name__}"
        )
    return kernel_cls, backend


class StagedForward:
    """Inputs staged by `MoEEpLayer.stage_inputs`, consumed once by that layer's
    `compute_staged` (another layer's `compute_staged` refuses it)."""

    def __init__(
        self,
        output: torch.Tensor,
        handle: Any,
        layer: MoEEpLayer,
        kernel: MegaKernel,
        load: torch.Tensor | None,
        live: int | None = None,
    ) -> None:
        self.output = output
        self.handle = handle
        self.layer = layer
        self.kernel = kernel
        """The kernel that staged it (`apply_placement` replaces the layer's)."""
        self.load = load
        """`[E]` this forward's pairs per logical expert, when the layer counts load."""
        self.live = live
        """The live-token count read from `num_valid_tokens_tensor` (None: all rows, or a
        forward under capture, whose count the kernel reads on the device)."""
        self.used = False


@contextlib.contextmanager
def _reported(runtime: Any, what: str) -> Iterator[None]:
    try:
        yield
    except BaseException as exc:
        runtime.report_failure(exc, what=what)  # no-op when a verdict broke it already
        raise


def _check_placement(kernel_cls: type[MegaKernel], placement: Placement | None) -> None:
    """A placement other than contiguous needs a kernel that honours it (before any collective)."""
    if placement is not None and not kernel_cls.supports_placement:
        raise MoeEpUsageError(
            f"kernel {kernel_cls.kernel_name!r} supports only the contiguous expert layout, "
            f"got fleet_params.placement={placement!r}; use a portable any_*_torch kernel "
            "or placement=None"
        )


def _check_stream(bootstrap: BootstrapConfig) -> None:
    """A non-zero `BootstrapConfig.stream` needs a CUDA rank (checked before any collective)."""
    if bootstrap.stream and resolve_local_device(bootstrap) is None:
        raise MoeEpUsageError(
            f"BootstrapConfig.stream={bootstrap.stream} is a CUDA stream handle, but this rank "
            "runs on CPU (no visible CUDA device); pass stream=0"
        )


def stream_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph (False on CPU):
    the one place the layer decides it (a test replaces it to simulate capture on CPU)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def device_pair_counts(
    topk_ids: torch.Tensor, num_experts: int, live: torch.Tensor | None
) -> torch.Tensor:
    """`[E]` int64 like `expert_pair_counts`, counting only the rows below `live` (a `(1,)`
    device count; None: every row), with no host read (a scatter-add into E + 1 bins, the
    last for -1 and ids outside `[0, E)`), so it can be captured."""
    ids = topk_ids.long()
    valid = (ids >= 0) & (ids < num_experts)
    if live is not None:
        rows = torch.arange(int(ids.shape[0]), device=ids.device)
        valid &= (rows < live.to(torch.int64))[:, None]
    bins = torch.where(valid, ids, num_experts).reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    return counts.scatter_add_(0, bins, torch.ones_like(bins))[:num_experts]


class MoEEpLayer:
    """An expert-parallel MoE layer on one EP rank.

    Construction (collective) validates everything locally first (expert count against the
    world size, weight shapes / dtypes / packed fp4 halves / scale planes, the kernel's
    availability), then acquires the runtime (`moe_ep.runtime.acquire`, which joins or
    creates the process group), checks that every rank asked for the same kernel, config,
    fleet params and weight shapes (one bounded gather; a mismatch raises `MoeEpUsageError`
    on every rank), prepares the weights once, and ends with a barrier.

    Args:
        bootstrap: how this rank joins the fleet (`moe_ep.BootstrapConfig`).
        fleet_params: `FleetParams(num_experts, max_tokens_per_rank, hidden_size)`, the same
            on every rank.
        weights: `MoEWeightPack` of this rank's `E_local` experts (rank r owns experts
            `[r*E_local, (r+1)*E_local)`), or under `fleet_params.placement` of its slots
            in slot order (`moe_ep.placement_weights.slice_weights` cuts them from the full
            weights; docs/placement.md).
        fleet_knobs: flashinfer.moe_ep's transport knobs: must be empty (moe-ep has no
            split transport). A kernel name or config here is the backend (moe-ep's own
            order, `MoEEpLayer(bootstrap, fleet, weights, backend)`).
        backend: a kernel name such as `"any_bf16_bf16_bf16_torch"` (default config, with
            the knobs `moe-ep tune` cached for this problem: docs/performance.md), a
            kernel config object (e.g. `Any_Bf16_Bf16_Bf16_Torch_MegaMoeConfig(dedup=False)`,
            used as given), or flashinfer's `MegaConfig(megakernel=<either>)`
            (`moe_ep.compat.flashinfer`).
        count_load: count each forward's pairs per logical expert (`expert_load`); off by
            default (then it costs nothing).
        eviction: None (default: `evict()` refused), "mask" or "replicate" (needs every
            expert on at least two ranks): how `evict()` goes on without failed ranks
            (docs/placement.md, "Eviction").
        auto_evict: the automatic policy (needs `eviction`): `forward()` that meets a
            verdict naming other ranks evicts them and computes the same tokens again
            over the survivors, instead of raising.

    Bad input on one rank raises `MoeEpUsageError` on that rank before any collective; at
    world size > 1 that rank also writes its reason into the store, so the peers waiting
    for it in a collective fail at once with `MoeEpPeerError` naming it (`failed_ranks`,
    `reasons`). Any failure of a forward or of the construction after joining the group
    breaks the runtime on every rank (a collective was abandoned): later calls raise at
    once, `destroy()` is local. Every wait is bounded by `BootstrapConfig.timeout_s`
    (docs/runtime.md).

    A non-zero `BootstrapConfig.stream` (a `cudaStream_t` as an int) is where the layer
    works: the kernel's construction (weight preparation), `stage_inputs` (the input checks
    included), `compute_staged`, `warmup` and `destroy` run inside
    `torch.cuda.stream(torch.cuda.ExternalStream(stream))`, so the output allocation, the
    staging copies and every kernel launch (they launch on the current stream) go to it.
    Refused on a CPU rank. Warning: this CUDA path has never run on a GPU (tested on CPU
    with a fake stream).
    """

    def __init__(
        self,
        bootstrap: BootstrapConfig,
        fleet_params: FleetParams,
        weights: MoEWeightPack,
        fleet_knobs: Sequence[object] | KernelConfig = (),
        backend: str | KernelConfig | object = None,
        *,
        count_load: bool = False,
        eviction: str | None = None,
        auto_evict: bool = False,
    ) -> None:
        if not isinstance(bootstrap, BootstrapConfig):
            raise MoeEpUsageError(
                f"bootstrap must be a moe_ep.BootstrapConfig, got {type(bootstrap).__name__}"
            )
        if not isinstance(fleet_params, FleetParams):
            raise MoeEpUsageError(
                f"fleet_params must be a moe_ep.FleetParams, got {type(fleet_params).__name__}"
            )
        if not isinstance(weights, MoEWeightPack):
            raise MoeEpUsageError(
                f"weights must be a moe_ep.MoEWeightPack, got {type(weights).__name__}"
            )
        if type(count_load) is not bool:
            raise MoeEpUsageError(f"count_load must be a bool, got {count_load!r}")
        _check_stream(bootstrap)
        chosen = layer_backend(fleet_knobs, backend)
        kernel_cls, config = resolve_backend(chosen)
        _check_placement(kernel_cls, fleet_params.placement)
        if type(auto_evict) is not bool or (auto_evict and eviction is None):
            raise MoeEpUsageError(
                f"auto_evict must be a bool, and True only with eviction='mask' or "
                f"'replicate': got auto_evict={auto_evict!r}, eviction={eviction!r}"
            )
        if eviction is not None:
            fleet_params.experts_per_rank(bootstrap.world_size)  # the placement's world size
            check_mode(
                eviction,
                fleet_params.placement
                or Placement.contiguous(fleet_params.num_experts, bootstrap.world_size),
            )
        ok, reason = kernel_cls.availability()
        if not ok:
            raise MoeEpUnavailableError(f"kernel {kernel_cls.kernel_name!r}: {reason}")
        world_size = bootstrap.world_size
        shape = kernel_cls.validate_weights(weights, fleet_params, world_size, config)
        if isinstance(chosen, str):  # by name: the tuned knobs
            config, shape = layer_config(
                kernel_cls, config, fleet_params, weights, shape, bootstrap
            )
        self.fleet = fleet_params
        self.kernel_name = kernel_cls.kernel_name
        self.config = config
        self._kernel_cls = kernel_cls
        self._weights: MoEWeightPack | None = weights
        """The caller's pack, kept for `apply_placement` / `evict` unless the kernel
        rebuilds it (`MegaKernel.rebuilds_weights`: then None, `_weight_pack`)."""
        self._destroyed = False
        self._load: torch.Tensor | None = None
        self.eviction = eviction
        self.auto_evict = auto_evict
        self._masked: torch.Tensor | None = None  # experts evicted in mask mode
        from moe_ep.runtime import acquire

        self._runtime = acquire(bootstrap, requirements=kernel_cls.requirements)
        try:
            self._stream = (
                torch.cuda.ExternalStream(bootstrap.stream, device=self._runtime.device)
                if bootstrap.stream
                else None
            )
            agree_on_setup(
                self._runtime,
                setup_fingerprint(kernel_cls.kernel_name, config, fleet_params, weights),
            )
            with (
                self._on_stream(),
                caller_validated_weights(weights, fleet_params, world_size, config, shape),
            ):
                self._kernel: MegaKernel = kernel_cls(
                    config=config, fleet=fleet_params, runtime=self._runtime, weights=weights
                )
            self._keep_weights(weights)
            if count_load:
                self._load = torch.zeros(
                    fleet_params.num_experts, dtype=torch.int64, device=self._runtime.device
                )
            self._runtime.barrier()
        except BaseException as exc:
            self._abandon_construction(exc)
            raise

    def _abandon_construction(self, exc: BaseException) -> None:
        """A construction failed after joining the group: tell the peers (they fail at once
        naming this rank, instead of timing out in the next step), then release locally.
        The construction's own error is what the caller sees; a teardown error becomes a
        note on it."""
        self._runtime.report_failure(exc, what="moe-ep layer construction")
        try:
            self._runtime.release()
        except BaseException as teardown:
            exc.add_note(
                f"then releasing the runtime failed too: {type(teardown).__name__}: {teardown}"
            )

    def _collective(self, what: str) -> contextlib.AbstractContextManager[Any]:
        """Around a call whose peers may wait for this rank in a collective: a broken
        runtime raises at once; an exception raised here is reported to the peers (they
        fail at once naming this rank and it) and breaks the runtime."""
        rt = self._live()
        rt.check_usable(what)
        return _reported(rt, what)

    # -- properties ---------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._live().rank

    @property
    def world_size(self) -> int:
        return self._live().world_size

    @property
    def device(self) -> torch.device:
        return self._live().device

    @property
    def destroyed(self) -> bool:
        return self._destroyed

    @property
    def placement(self) -> Placement:
        """The layout the next forward uses (contiguous unless given or applied)."""
        rt = self._live()
        p = self.fleet.placement
        return Placement.contiguous(self.fleet.num_experts, rt.world_size) if p is None else p

    @property
    def expert_load(self) -> torch.Tensor:
        """`[E]` int64 on the layer's device: this rank's (token, slot) pairs per logical
        expert, summed over the forwards computed since construction or
        `reset_expert_load()` (`-1` slots skipped; an expert twice in a row counts twice).
        Sum it over the ranks for the fleet's load (e.g. for `balance_placement`).
        Needs `count_load=True`."""
        self._live()
        if self._load is None:
            raise MoeEpUsageError(
                "expert_load needs load counting: construct the layer with count_load=True"
            )
        return self._load

    def reset_expert_load(self) -> None:
        """Zero `expert_load` (local)."""
        self.expert_load.zero_()

    def _live(self) -> Any:
        if self._destroyed:
            raise MoeEpUsageError("this MoEEpLayer was destroyed; construct a new one")
        return self._runtime

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        """`BootstrapConfig.stream` as the current stream (no-op for stream 0)."""
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    # -- forward ------------------------------------------------------------------------
    def stage_inputs(self, tensors: MoEEpTensors) -> StagedForward:
        """Validate `tensors`, allocate (or take) the output, stage inputs (no collective).

        Returns a handle for one `compute_staged` call; its `output` is `[n, H]` bf16,
        valid once `compute_staged` returns.
        """
        return self._stage(tensors, unfinalized=False)

    def _stage(self, tensors: MoEEpTensors, *, unfinalized: bool) -> StagedForward:
        rt = self._live()
        what = "forward_unfinalized" if unfinalized else "forward"
        with self._collective(f"moe-ep {what} (stage_inputs)"):
            if unfinalized and not self._kernel_cls.supports_unfinalized:
                raise MoeEpUsageError(
                    f"kernel {self.kernel_name!r} has no unfinalized forward (its top-k "
                    "reduce is fused into the kernel): use forward(), or a portable "
                    "any_*_torch kernel for forward_unfinalized()"
                )
            # on the caller's stream, the one a capture records: before switching to ours
            capturing = self._check_not_capturing(rt.device)
            with self._on_stream():  # the checks read the inputs too: on the layer's stream
                return self._stage_on_stream(tensors, rt.device, unfinalized, capturing)

    def _stage_on_stream(
        self, tensors: MoEEpTensors, device: torch.device, unfinalized: bool, capturing: bool
    ) -> StagedForward:
        """`_stage`'s checks and staging. Under capture (`capturing`, a capturable kernel)
        no device value is read on the host: the value checks are skipped, the live count
        goes to the kernel as the device tensor and the load is counted on the device."""
        out = validate_forward(tensors, self.fleet, device)
        if unfinalized and out is not None:
            raise MoeEpUsageError(
                "MoEEpTensors.output must be None for forward_unfinalized(): it returns "
                "its own (rows, weights, route_map) and writes no [n, H] output"
            )
        if not capturing:
            check_forward_values(tensors, self.fleet)
        live = self._live_tokens(tensors, device, unfinalized, capturing)
        on_device = self._kernel.capturable and tensors.num_valid_tokens_tensor is not None
        if self._masked is not None:  # no surviving copy: routed nowhere, not renormalised
            ids = tensors.topk_ids
            hit = (ids[..., None] == self._masked).any(dim=-1)  # isin's sort path syncs
            tensors = dataclasses.replace(tensors, topk_ids=torch.where(hit, -1, ids))
        if tensors.topk_weights.dtype != torch.float32:  # bf16 / fp16: exact
            tensors = dataclasses.replace(tensors, topk_weights=tensors.topk_weights.float())
        if out is None:
            alloc = torch.zeros if on_device or live is not None else torch.empty
            out = alloc(
                (tensors.num_tokens, self.fleet.hidden_size), dtype=torch.bfloat16, device=device
            )
        kernel_out = out
        # a capturable kernel takes every row and the count tensor (fixed shapes for capture)
        if live is not None and not on_device:  # the others see the live rows only
            tensors = dataclasses.replace(
                tensors,
                hidden_states=tensors.hidden_states[:live],
                topk_ids=tensors.topk_ids[:live],
                topk_weights=tensors.topk_weights[:live],
                output=None,
                num_valid_tokens_tensor=None,
            )
            kernel_out = out[:live]
        handle = self._kernel.stage_inputs(tensors=tensors, output=kernel_out)
        load = None
        if self._load is not None:
            load = (
                device_pair_counts(
                    tensors.topk_ids, self.fleet.num_experts, tensors.num_valid_tokens_tensor
                )
                if self._kernel.capturable
                else expert_pair_counts(tensors.topk_ids, self.fleet.num_experts)
            )
        return StagedForward(out, handle, self, self._kernel, load, live)

    def _check_not_capturing(self, device: torch.device) -> bool:
        """Whether this forward is being captured (`stream_capturing`); refused for a kernel
        instance that is not `capturable`, or on another stream than the layer's own."""
        if not stream_capturing(device):
            return False
        if not self._kernel.capturable:
            raise MoeEpUsageError(
                f"kernel {self.kernel_name!r} cannot be captured in a CUDA graph: its forward "
                "reads routing counts on the host (docs/runtime.md, 'Graph capture'); run "
                "this layer outside the capture, or use any_bf16_bf16_bf16_torch with "
                "capture_safe=True"
            )
        if self._stream is not None:
            capturing_on = torch.cuda.current_stream(device).cuda_stream
            if capturing_on != self._stream.cuda_stream:
                raise MoeEpUsageError(
                    f"this layer works on BootstrapConfig.stream={self._stream.cuda_stream}, "
                    f"but the capture records stream {capturing_on}: the layer's work would "
                    "run outside the graph; capture on the layer's stream"
                )
        return True

    def _live_tokens(
        self, tensors: MoEEpTensors, device: torch.device, unfinalized: bool, capturing: bool
    ) -> int | None:
        """The checked live-token count, None without one (refused where not honoured);
        None under capture too (its value is not read: the kernel reads it on the device)."""
        if tensors.num_valid_tokens_tensor is None:
            return None
        if not self._kernel_cls.supports_live_tokens:
            raise MoeEpUsageError(
                f"kernel {self.kernel_name!r} does not honour "
                "MoEEpTensors.num_valid_tokens_tensor (its launch takes the token count "
                "from the tensor shapes): pass num_valid_tokens_tensor=None and mark padding "
                "rows with topk_ids -1, or use a portable any_*_torch kernel"
            )
        if unfinalized:
            raise MoeEpUsageError(
                "num_valid_tokens_tensor must be None for forward_unfinalized() (as in "
                "flashinfer, a live count and the unfinalized result do not combine): "
                "pass only the live rows"
            )
        if capturing:
            check_live_tensor(tensors, device)
            return None
        return live_token_count(tensors, self.fleet, device)

    def compute_staged(self, staged: StagedForward) -> torch.Tensor:
        """Collective: dispatch, run the experts, combine; returns `[n, H]` bf16."""
        out: torch.Tensor = self._compute(staged, unfinalized=False)
        return out if staged.live is None else staged.output

    def _compute(self, staged: StagedForward, *, unfinalized: bool) -> Any:
        what = "forward_unfinalized" if unfinalized else "forward"
        with self._collective(f"moe-ep {what} (compute_staged)"):
            if not isinstance(staged, StagedForward) or staged.layer is not self:
                raise MoeEpUsageError("staged must come from this layer's stage_inputs()")
            if staged.used:
                raise MoeEpUsageError("this staged forward was already computed; stage again")
            if staged.kernel is not self._kernel:
                raise MoeEpUsageError(
                    "this forward was staged before apply_placement() changed the layout; "
                    "stage it again"
                )
            staged.used = True
            with self._on_stream():
                kernel = self._kernel
                run = kernel.compute_unfinalized if unfinalized else kernel.compute_staged
                out = run(staged=staged.handle)
            if self._load is not None and staged.load is not None:
                self._load += staged.load
            return out

    def forward(self, tensors: MoEEpTensors) -> torch.Tensor:
        """Collective: `[n, H]` bf16 = sum over k of `topk_weights[:, k] * expert(x)`.

        With `auto_evict`, a verdict naming other ranks is evicted and the same tokens
        computed again over the survivors (a survivor failing in the eviction too)."""
        if not self.auto_evict:
            return self.compute_staged(self.stage_inputs(tensors))
        return self._forward_evicting(tensors)

    def _forward_evicting(self, tensors: MoEEpTensors) -> torch.Tensor:
        failure: MoeEpPeerError | None = None
        for _ in range(self.world_size):  # each eviction loses at least one rank
            try:
                return self.compute_staged(self.stage_inputs(tensors))
            except MoeEpPeerError as exc:
                failure = exc
            for _ in range(self.world_size):
                if self.rank in failure.failed_ranks or not failure.failed_ranks:
                    raise failure  # this rank was evicted, or nobody could be named
                try:
                    self.evict(failure.failed_ranks)
                    break
                except MoeEpPeerError as again:  # a survivor failed during the eviction
                    failure = again
        assert failure is not None
        raise failure

    def forward_unfinalized(
        self, tensors: MoEEpTensors
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Collective: `forward` without the top-k reduce, for a host that fuses it (e.g.
        with its residual add); flashinfer 0.7.4's `forward_unfinalized` layout.

        Returns `(rows, weights, route_map)`: rows `[n*k, H]` bf16 (each (token, slot)'s
        expert output), weights `[n, k]` fp32 (what the host still multiplies: the
        top-k weights, or ones under `apply_routing_weights_before_fc2`), route_map
        `[n, k]` int32 (`route_map[t, j]` is the row of slot j of token t; here the
        identity `t*k + j`). A padded slot (id -1) has a zero row and weight 0.
        `forward(tensors)` equals `bf16(sum_j weights[:, j] * rows[route_map[:, j]])`,
        summed in fp32 in slot order. `tensors.output` must be None; only kernels with
        `supports_unfinalized` (the portable ones) have it (docs/runtime.md).
        """
        staged = self._stage(tensors, unfinalized=True)
        result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = self._compute(
            staged, unfinalized=True
        )
        return result

    __call__ = forward

    # -- placement ----------------------------------------------------------------------
    def apply_placement(self, placement: Placement) -> None:
        """Collective, between forwards: the next forward uses `placement`.

        Every rank first checks `placement` locally (same experts and world size; a kernel
        that honours placements), then all agree on its digest (one bounded gather: if any
        rank passed another placement every rank raises the same `MoeEpUsageError` naming
        the ranks and their digests, before any weight moves, and the layer keeps its
        layout and stays usable), then the weights move over the group (one all-to-all
        per pack tensor, each bounded by `BootstrapConfig.timeout_s`), the kernel is rebuilt
        on them and the ranks meet at a barrier. Load counts are kept (they are logical).

        Raises:
            MoeEpUsageError: a bad `placement` on this rank (its peers then fail at once
                with `MoeEpPeerError` naming it), or the ranks disagree (every rank).
            MoeEpPeerError / MoeEpTimeoutError: a peer failed or did not arrive in time
                (the runtime is broken then).
        """
        rt = self._live()
        with self._collective("moe-ep apply_placement (checks)"):
            if not isinstance(placement, Placement):
                raise MoeEpUsageError(
                    "placement must be a moe_ep.placement.Placement, got "
                    f"{type(placement).__name__}"
                )
            fleet = dataclasses.replace(self.fleet, placement=placement)
            _check_placement(self._kernel_cls, fleet.placement)
            old = self.placement
            sources = transfer_sources(old, placement)
        agree(
            rt,
            {"placement digest": placement.digest},
            subject="placements",
            what="moe-ep apply_placement (digest check)",
        )
        with self._collective("moe-ep apply_placement (weights)"), self._on_stream():
            weights = move_weights(rt, self._weight_pack(), old, placement, sources)
            kernel = self._kernel_cls(config=self.config, fleet=fleet, runtime=rt, weights=weights)
            self._kernel.destroy()
            self._kernel, self.fleet = kernel, fleet
            self._keep_weights(weights)
            rt.barrier()

    def _keep_weights(self, weights: MoEWeightPack) -> None:
        """Hold `weights` (the pack the kernel was just built on) unless the kernel can
        give it back (`MegaKernel.rebuilds_weights`): then hold nothing, so the caller's
        tensors are freed once the caller drops them."""
        self._weights = None if self._kernel.rebuilds_weights else weights

    def _weight_pack(self) -> MoEWeightPack:
        """The pack the kernel was built on: the one held, else the kernel's rebuilt copy."""
        return self._weights if self._weights is not None else self._kernel.rebuilt_weights()

    # -- eviction -----------------------------------------------------------------------
    def evict(self, failed_ranks: Sequence[int]) -> list[int]:
        """Collective over the survivors, after a `MoeEpPeerError` whose `failed_ranks` this
        rank raised: rebuild the EP group over the others (a new gloo group through the
        store, every wait bounded by `timeout_s`) and go on serving the same logical
        experts; the layer's rank and world size become the survivors' (new rank i was old
        rank `survivors[i]`, returned). Mode "replicate": every expert still has a copy, and
        the outputs equal the layer's before the failure, bit for bit. Mode "mask": pairs
        routed to an expert with no surviving copy contribute zero, their top-k weights
        not renormalised (a `RuntimeWarning` names the experts).

        Raises:
            MoeEpUsageError: no eviction mode, a healthy group, `failed_ranks` other than
                the verdict's, this rank among them (an evicted rank cannot rejoin), or
                replicate mode with an expert whose every copy was lost (every survivor,
                before any collective); the survivors disagreeing (every survivor).
            MoeEpUnavailableError: a host's group, or the store's host among the failed.
            MoeEpPeerError / MoeEpTimeoutError: a survivor failed during the eviction; the
                same verdict on every other survivor, in the numbering before it (evict
                again with it).
        """
        rt = self._live()
        state, failed = check_eviction(rt, self.eviction, failed_ranks)
        assert self.eviction is not None
        placement = survivor_placement(self.placement, failed, self.eviction)
        fleet = dataclasses.replace(self.fleet, placement=placement)
        weights = self._weights = self._weight_pack()  # held until a kernel is rebuilt on it
        with contextlib.suppress(MoeEpPeerError):  # broken: its collective frees raise at once
            self._kernel.destroy()
        survivors = rebuild_group(state, failed)
        try:
            agree(
                rt,
                {
                    "eviction": str(self.eviction),
                    "failed ranks": str(list(failed)),
                    "placement digest": placement.digest,
                },
                subject="evictions",
                what="moe-ep evict (agreement)",
            )
        except MoeEpUsageError as exc:  # the old kernel is gone: nothing left to serve with
            state.mark_broken(MoeEpPeerError(f"moe-ep evict: {exc}", failed_ranks=()))
            raise
        with self._collective("moe-ep evict (rebuild)"), self._on_stream():
            self._kernel = self._kernel_cls(
                config=self.config, fleet=fleet, runtime=rt, weights=weights
            )
            self.fleet = fleet
            self._keep_weights(weights)
            if placement.masked:
                self._masked = torch.tensor(placement.masked, dtype=torch.int64, device=rt.device)
                warnings.warn(
                    f"moe-ep evict (mask mode): experts {list(placement.masked)} have no copy "
                    f"on the surviving ranks (failed: {list(failed)}); tokens routed to them "
                    "now contribute ZERO and their top-k weights are NOT renormalised, so "
                    "those tokens' outputs are degraded (docs/placement.md, 'Eviction')",
                    RuntimeWarning,
                    stacklevel=2,
                )
            rt.barrier()
        return survivors

    # -- lifecycle ----------------------------------------------------------------------
    def warmup(self) -> None:
        """Collective: let the kernel compile / allocate what a first forward would."""
        with self._collective("moe-ep warmup"), self._on_stream():
            self._kernel.warmup()

    def destroy(self) -> None:
        """Collective and idempotent: release the kernel's workspaces and the runtime.

        Not done in `__del__`: teardown is collective, and garbage collection runs at
        different times on different ranks, which would hang or break the peers.

        On a broken runtime (`Runtime.failure`) it is local and immediate: the kernel's
        collective frees are skipped (they raise at once; what they would free is not
        reclaimed) and the runtime is released without a barrier.
        """
        if self._destroyed:
            return
        self._destroyed = True
        try:
            with self._on_stream():
                if self._runtime.failure is None:
                    self._kernel.destroy()
                else:
                    with contextlib.suppress(MoeEpPeerError):
                        self._kernel.destroy()
        finally:
            self._runtime.release()

    def __enter__(self) -> MoEEpLayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = (
            "destroyed"
            if self._destroyed
            else f"rank {self._runtime.rank}/{self._runtime.world_size}"
        )
        return f"MoEEpLayer({self.kernel_name}, {self.fleet}, {state})"

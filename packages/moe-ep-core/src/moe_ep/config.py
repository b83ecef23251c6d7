"""`BootstrapConfig`: how one EP rank joins the fleet."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from moe_ep import env as _env
from moe_ep.errors import MoeEpUsageError

__all__ = ["BootstrapConfig"]


def _require_int(field: str, value: object, *, minimum: int) -> int:
    # bool is an int subclass; True as a rank or device is always a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise MoeEpUsageError(
            f"BootstrapConfig.{field} must be an int >= {minimum}, "
            f"got {value!r} ({type(value).__name__})"
        )
    if int(value) < minimum:
        raise MoeEpUsageError(f"BootstrapConfig.{field} must be >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class BootstrapConfig:
    """How this process joins the expert-parallel fleet (validated on construction).

    Args:
        world_size: number of EP ranks, >= 1.
        rank: this process's EP rank, `0 <= rank < world_size`.
        stream: a CUDA stream handle (`cudaStream_t` as an int, e.g.
            `torch.cuda.current_stream().cuda_stream`) an `MoEEpLayer` works on: its weight
            preparation, staging, kernels and copies run on
            `torch.cuda.ExternalStream(stream)`; 0 = the stream current at each call.
            `MoEEpLayer` refuses a non-zero stream on a CPU rank. Never run on a GPU.
        auto_bootstrap: initialise torch.distributed when no group exists; False makes
            `moe_ep.runtime.acquire` require a host-initialised group or `process_group`.
        nccl_comm: flashinfer.moe_ep's field for adopting a raw `ncclComm_t`; moe-ep cannot
            (it runs its collectives over a torch group), so only None is accepted: pass
            the torch group over the same ranks as `process_group`.
        process_group: the host's EP `torch.distributed.ProcessGroup` (reused, never
            destroyed by moe-ep); None = the default group.
        tcp_store: flashinfer.moe_ep's store for its NIXL transport; only None is accepted
            (moe-ep rendezvous through `init_method` / env:// or the host's group).
        device: keyword-only. CUDA ordinal to bind; None = `LOCAL_RANK`, else `rank`
            (see `moe_ep.device.resolve_local_device`). Hosts such as vLLM pass
            `torch.cuda.current_device()`.
        init_method: keyword-only. Explicit rendezvous URL (e.g. "tcp://10.0.0.1:29500")
            used when moe-ep initialises torch.distributed; None = env:// when
            MASTER_ADDR/MASTER_PORT are set.
        timeout_s: keyword-only. Seconds any bootstrap, barrier or teardown wait may take;
            None = MOE_EP_TIMEOUT_S, else 120.
        external_store: keyword-only. True: the rendezvous store at `init_method` (else
            MASTER_ADDR/MASTER_PORT) is served by a process that is no EP rank (e.g.
            `moe_ep.runtime.store_server.serve_store()` in a launcher or Ray driver);
            every rank, rank 0 included, connects to it as a client, as under torchrun's
            agent store, so losing any one rank (rank 0 too) leaves the store up and
            `MoEEpLayer.evict` can rebuild (docs/placement.md, "Eviction"). False
            (default): rank 0 hosts the store, except under torchrun
            (TORCHELASTIC_USE_AGENT_STORE) where the agent does. Needs
            auto_bootstrap=True and no process_group (a host's group brings its own
            store), and an address to reach (checked at acquire).

    The positional fields are flashinfer-python 0.7.4's `flashinfer.moe_ep.BootstrapConfig`,
    in its order (`world_size, rank, stream, auto_bootstrap, nccl_comm, process_group,
    tcp_store`), so a host written against it constructs this one unchanged; the rest are
    keyword-only, and every field added later will be too. (Before, `process_group` was the
    fifth positional: passed there it now lands in `nccl_comm`, which refuses it and says so.)

    Raises:
        MoeEpUsageError (a ValueError): a field of the wrong type or out of range; the
            message names the field and the value.
    """

    world_size: int
    rank: int
    stream: int = 0
    auto_bootstrap: bool = True
    nccl_comm: int | None = None
    process_group: Any = None
    tcp_store: Any = None
    _: KW_ONLY
    device: int | None = None
    init_method: str | None = None
    timeout_s: float | None = None
    external_store: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "world_size", _require_int("world_size", self.world_size, minimum=1))
        rank = _require_int("rank", self.rank, minimum=0)
        if rank >= self.world_size:
            raise MoeEpUsageError(
                f"BootstrapConfig.rank must satisfy 0 <= rank < world_size={self.world_size}, "
                f"got rank={rank}"
            )
        set_(self, "rank", rank)
        set_(self, "stream", _require_int("stream", self.stream, minimum=0))
        if not isinstance(self.auto_bootstrap, bool):
            raise MoeEpUsageError(
                f"BootstrapConfig.auto_bootstrap must be a bool, got {self.auto_bootstrap!r} "
                f"({type(self.auto_bootstrap).__name__})"
            )
        if self.nccl_comm is not None:
            moved = (
                ""
                if isinstance(self.nccl_comm, numbers.Integral)
                else "; a process group given as the fifth positional argument (moe-ep's order "
                "before flashinfer's) goes in process_group=, by keyword"
            )
            raise MoeEpUsageError(
                f"BootstrapConfig.nccl_comm must be None: moe-ep cannot adopt a raw ncclComm_t "
                f"(got {self.nccl_comm!r}); pass the torch ProcessGroup over the same ranks as "
                f"process_group{moved}"
            )
        if self.tcp_store is not None:
            raise MoeEpUsageError(
                f"BootstrapConfig.tcp_store must be None: moe-ep has no NIXL transport and "
                f"rendezvous through init_method / env:// or the host's group (got "
                f"{type(self.tcp_store).__name__})"
            )
        if self.process_group is not None and isinstance(
            self.process_group, str | bytes | numbers.Number | Mapping
        ):
            raise MoeEpUsageError(
                "BootstrapConfig.process_group must be a torch.distributed.ProcessGroup or "
                f"None, got {self.process_group!r} ({type(self.process_group).__name__})"
            )
        if self.device is not None:
            set_(self, "device", _require_int("device", self.device, minimum=0))
        if self.init_method is not None and (
            not isinstance(self.init_method, str) or "://" not in self.init_method
        ):
            raise MoeEpUsageError(
                "BootstrapConfig.init_method must be None or a URL such as "
                f"'tcp://127.0.0.1:29500', got {self.init_method!r}"
            )
        if self.timeout_s is not None:
            t = self.timeout_s
            if (
                isinstance(t, bool)
                or not isinstance(t, numbers.Real)
                or not 0 < float(t) <= _env.MAX_TIMEOUT_S  # NaN fails too
            ):
                raise MoeEpUsageError(
                    f"BootstrapConfig.timeout_s must be a number of seconds > 0 and <= "
                    f"{_env.MAX_TIMEOUT_S:g} (one week), or None, got {t!r}"
                )
            set_(self, "timeout_s", float(t))
        if not isinstance(self.external_store, bool):
            raise MoeEpUsageError(
                f"BootstrapConfig.external_store must be a bool, got {self.external_store!r} "
                f"({type(self.external_store).__name__})"
            )
        if self.external_store and not self.auto_bootstrap:
            raise MoeEpUsageError(
                "BootstrapConfig.external_store=True contradicts auto_bootstrap=False: the "
                "store is only joined when moe-ep initialises torch.distributed itself"
            )
        if self.external_store and self.process_group is not None:
            raise MoeEpUsageError(
                "BootstrapConfig.external_store=True contradicts process_group=: moe-ep "
                "then uses the host's group and the host's store, and joins no store itself"
            )

    def effective_timeout_s(self, env: Mapping[str, str] | None = None) -> float:
        """`timeout_s`, else MOE_EP_TIMEOUT_S from `env` (default `os.environ`), else 120."""
        if self.timeout_s is not None:
            return self.timeout_s
        from_env = _env.timeout_s(env)
        return _env.DEFAULT_TIMEOUT_S if from_env is None else from_env

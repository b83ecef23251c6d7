"""`Sm90PullCutedslKernel`: what the sm90 pull kernels' classes share on core's CuTe DSL base
(one drop: its availability, its call arguments, its combine region); each kernel adds its
drop classes (`_make_kernel`), tensor arguments, weights and stager."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from moe_ep.backends.support.cutedsl.mega_kernel import CutedslMegaKernel, raw_workspace_pointers
from moe_ep_sm90.common.pull_args import pull_call_args
from moe_ep_sm90.common.pull_drop import combine_region, pull_availability

if TYPE_CHECKING:
    import torch

    from moe_ep.backends.support.launch_args import LaunchGeometry

__all__ = ["Sm90PullCutedslKernel"]


class Sm90PullCutedslKernel(CutedslMegaKernel):
    """Base of the sm90 pull kernels (the `sm90_pull_cutedsl` drop): availability, the
    `__call__` arguments with raw workspace pointers, the bf16 combine cells."""

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return pull_availability()

    def _call_args(
        self, g: LaunchGeometry, workspaces: tuple[torch.Tensor, torch.Tensor], common: Any
    ) -> dict[str, Any]:
        return pull_call_args(
            self._tensor_specs(g), pointer=raw_workspace_pointers(workspaces), **common
        )

    def _combine_region(self, kernel: Any, g: LaunchGeometry) -> tuple[int, int]:
        return combine_region(kernel, g)

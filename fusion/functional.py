"""`all_reduce_add_rms_norm`: one reduction by an explicit strategy, without an `AllReduceFusion`
(benchmarks and engines that keep their own dispatch).

    residual_out = sum over ranks of x + residual;  normed = rms_norm(residual_out) * weight

The symmetric-memory strategies own buffers made together by every rank: they run through an
op (`AllReduceFusion.run`), never here.
"""
from __future__ import annotations

from typing import Optional

import torch

from fusion.backends.base import Backend
from fusion.backends.flashinfer import FlashInferOneShotBackend, FlashInferTwoShotBackend
from fusion.backends.flashinfer_workspace import AllReduceFusionWorkspace
from fusion.backends.reduce_then_norm import NcclBackend, TorchBackend
from fusion.errors import FusionInputError
from fusion.group import TensorParallelGroup
from fusion.platform import hidden_alignment_error
from fusion.strategy import FusedOutput, Quant, Strategy
from fusion.validation import check_fusion_inputs


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: torch.Tensor,
    eps: float,
    *,
    group: TensorParallelGroup,
    strategy: Strategy = Strategy.NCCL,
    workspace: Optional[AllReduceFusionWorkspace] = None,
    quant: Optional[Quant] = None,
    launch_with_pdl: bool = True,
) -> FusedOutput:
    """All-reduce + residual add + RMSNorm over ``group`` by ``strategy``; ``x`` and ``residual``
    are consumed. ``workspace``: an ensured `AllReduceFusionWorkspace`, for the flashinfer
    strategies only. Raises `FusionInputError` naming the problem for inputs the strategy cannot
    take, before any collective; it never silently changes the strategy."""
    strategy = Strategy(strategy)
    check_fusion_inputs(x, residual, weight)
    backend: Backend
    if strategy is Strategy.NCCL:
        backend = NcclBackend(group)
    elif strategy is Strategy.TORCH:
        backend = TorchBackend(group)
        backend.ensure(x.shape[0], x.shape[1], x.dtype)
    elif strategy in (Strategy.FLASHINFER_ONE_SHOT, Strategy.FLASHINFER_TWO_SHOT):
        if workspace is None or not workspace.ready:
            raise FusionInputError("no fusion workspace: create it (AllReduceFusionWorkspace.ensure) before the call")
        if workspace.group.world_size != group.world_size:
            raise FusionInputError(f"the workspace was made for {workspace.group.world_size} ranks, the group has "
                                   f"{group.world_size}")
        misaligned = hidden_alignment_error(x.shape[1], x.dtype)
        if misaligned:
            raise FusionInputError(misaligned)
        kind = FlashInferOneShotBackend if strategy is Strategy.FLASHINFER_ONE_SHOT else FlashInferTwoShotBackend
        backend = kind(group, workspace, launch_with_pdl)
    else:
        raise FusionInputError(f"{strategy} owns symmetric buffers: run it through AllReduceFusion.run")
    return backend.run(x, residual, weight, eps, quant)

"""`all_reduce_add_rms_norm`: one reduction by an explicit strategy, without an `AllReduceFusion`
(benchmarks and engines that keep their own dispatch).

    residual_out = sum over ranks of x + residual;  normed = rms_norm(residual_out) * weight

It runs the op's own backends (`fusion.strategies`), each made for the one call
(`Backend.standalone`); the strategies whose buffers every rank makes together run through an op
(`AllReduceFusion.run`), never here.
"""
from __future__ import annotations

import torch
from arfusion.fusion.backends.flashinfer_workspace import AllReduceFusionWorkspace
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.strategies import BACKENDS
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy
from arfusion.fusion.validation import check_fusion_inputs


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    group: TensorParallelGroup,
    strategy: Strategy = Strategy.NCCL,
    workspace: AllReduceFusionWorkspace | None = None,
    quant: Quant | None = None,
    launch_with_pdl: bool = True,
) -> FusedOutput:
    """All-reduce + residual add + RMSNorm over ``group`` by ``strategy``; ``x`` and ``residual``
    are consumed. ``workspace``: an ensured `AllReduceFusionWorkspace`, for the flashinfer
    strategies only. Raises `FusionInputError` naming the problem for inputs the strategy cannot
    take, before any collective; it never silently changes the strategy."""
    strategy = Strategy(strategy)
    check_fusion_inputs(x, residual, weight)
    backend = BACKENDS[strategy].standalone(group, x, workspace, launch_with_pdl)
    return backend.run(x, residual, weight, eps, quant)

"""The backends that reduce first and normalise after: NCCL + norm (the unfused reference) and
the torch reference of the fused semantics (any device).

    nccl   all-reduce ``x`` in place over the group's device group, then add + RMSNorm
           (flashinfer's in-place kernels on GPU, torch elsewhere: `fusion.norm`)
    torch  the same reduction, then fp32 add + RMSNorm out of place (`fusion.reference`):
           the fused path of the "torch" fusion backend, for CPU tests and devices without
           flashinfer

Neither owns a resource. NCCL runs every batch; the torch backend takes up to the token limit
it was ensured for (the engine's fusion limit), as a fused backend would.

With ``deterministic`` both follow the canonical recipe instead (`fusion.backends.deterministic.reduce_then_norm`:
the rank-order sum, then on the GPU the fused kernels' own row step, elsewhere the recipe in
torch), so each gives a row the bits every other allowed strategy gives it.
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from arfusion.fusion import norm, reference
from arfusion.fusion.backends import deterministic
from arfusion.fusion.backends.base import (
    NO_ROWS,
    Backend,
    BuildContext,
    Costs,
    Made,
    Rows,
    quantized,
)
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.options import FLASHINFER, TORCH
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy


class NcclBackend(Backend):
    """group all-reduce (NCCL on GPU), then add + RMSNorm: the unfused reference"""

    strategy = Strategy.NCCL
    options = (FLASHINFER, TORCH)
    fallback = True
    cost: ClassVar[Costs] = {2: (9.555, 5.937, 0.001959)}

    def __init__(self, group: TensorParallelGroup, deterministic: bool = False) -> None:
        super().__init__(group)
        self.deterministic = deterministic

    @classmethod
    def for_op(cls, context: BuildContext) -> NcclBackend:
        return cls(context.group, context.deterministic)

    @classmethod
    def standalone(cls, group: TensorParallelGroup, x: torch.Tensor, workspace: Any,
                   launch_with_pdl: bool) -> NcclBackend:
        return cls(group)

    def _ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        return True

    def rows(self) -> Rows:
        return Rows(0, None)

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant: Quant | None = None) -> FusedOutput:
        """In place where `fusion.norm.add_rms_norm` is: ``x`` ends as the normed output and
        ``residual`` as the sum."""
        if self.deterministic:
            out = FusedOutput(*deterministic.reduce_then_norm(self.group, x, residual, weight, eps))
        else:
            self.group.all_reduce(x)
            out = FusedOutput(*norm.add_rms_norm(x, residual, weight, eps))
        return out if quant is None else quantized(out, quant)


class TorchBackend(Backend):
    """the same math in one function on any device (CPU tests, no flashinfer)"""

    strategy = Strategy.TORCH
    options = (TORCH,)
    made = Made.PRIMARY
    fallback_rank = 3
    measured = False

    def __init__(self, group: TensorParallelGroup, deterministic: bool = False) -> None:
        super().__init__(group)
        self.deterministic = deterministic
        self.max_tokens = 0

    @classmethod
    def for_op(cls, context: BuildContext) -> TorchBackend:
        return cls(context.group, context.deterministic)

    @classmethod
    def standalone(cls, group: TensorParallelGroup, x: torch.Tensor, workspace: Any,
                   launch_with_pdl: bool) -> TorchBackend:
        backend = cls(group)
        backend.ensure(x.shape[0], x.shape[1], x.dtype)
        return backend

    def _ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        self.max_tokens = max(self.max_tokens, max_tokens)
        return True

    def rows(self) -> Rows:
        return Rows(1, self.max_tokens) if self.max_tokens else NO_ROWS

    @property
    def capacity(self) -> int:
        return self.max_tokens

    def _destroy(self) -> None:
        self.max_tokens = 0

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant: Quant | None = None) -> FusedOutput:
        """``x`` is reduced in place; the outputs are new tensors (``residual`` is not written).

        The common case (default mode, no ``quant``, more than one rank, no capturable stand-in
        on the group) is this one Python call: the device group's all-reduce, which is what
        `TensorParallelGroup.all_reduce` runs there, then `fusion.reference.add_rms_norm`'s ops
        written out in the same order (so the same bits; tests/test_fusion_ops.py compares
        them bit for bit)."""
        group = self.group
        if quant is not None or self.deterministic or group.world_size == 1 or group.capturable is not None:
            return self._run(x, residual, weight, eps, quant)
        dist.all_reduce(x, group=group.device_group)
        summed = x if residual is None else (x.float() + residual.float()).to(x.dtype)
        s = summed.float()
        return FusedOutput((s * torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()).to(x.dtype),
                           summed)

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             quant: Quant | None) -> FusedOutput:
        """`run` through the group's collectives and the reference (or the canonical recipe)."""
        if self.deterministic:
            out = FusedOutput(*deterministic.reduce_then_norm(self.group, x, residual, weight, eps))
        else:
            self.group.all_reduce(x)
            out = FusedOutput(*reference.add_rms_norm(x, residual, weight, eps))
        return out if quant is None else quantized(out, quant)

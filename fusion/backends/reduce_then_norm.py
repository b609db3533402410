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

from typing import Optional

import torch

from fusion import norm, reference
from fusion.backends import deterministic
from fusion.backends.base import Backend, quantized
from fusion.group import TensorParallelGroup
from fusion.strategy import FusedOutput, Quant, Strategy


class NcclBackend(Backend):
    strategy = Strategy.NCCL

    def __init__(self, group: TensorParallelGroup, deterministic: bool = False) -> None:
        super().__init__(group)
        self.deterministic = deterministic

    def ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        return True

    def fits(self, num_tokens: int) -> bool:
        return True

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group, in place; returns ``x``."""
        return self.group.all_reduce(x)

    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
            quant: Optional[Quant] = None) -> FusedOutput:
        """In place where `fusion.norm.add_rms_norm` is: ``x`` ends as the normed output and
        ``residual`` as the sum."""
        if self.deterministic:
            return quantized(*deterministic.reduce_then_norm(self.group, x, residual, weight, eps), quant)
        self.group.all_reduce(x)
        return quantized(*norm.add_rms_norm(x, residual, weight, eps), quant)


class TorchBackend(Backend):
    strategy = Strategy.TORCH

    def __init__(self, group: TensorParallelGroup, deterministic: bool = False) -> None:
        super().__init__(group)
        self.deterministic = deterministic
        self.max_tokens = 0

    def ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        self.max_tokens = max(self.max_tokens, max_tokens)
        return True

    def fits(self, num_tokens: int) -> bool:
        return 1 <= num_tokens <= self.max_tokens

    @property
    def capacity(self) -> int:
        return self.max_tokens

    def destroy(self) -> None:
        self.max_tokens = 0

    def run(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float,
            quant: Optional[Quant] = None) -> FusedOutput:
        """``x`` is reduced in place; the outputs are new tensors (``residual`` is not written
        off the GPU)."""
        if self.deterministic:
            return quantized(*deterministic.reduce_then_norm(self.group, x, residual, weight, eps), quant)
        self.group.all_reduce(x)
        return quantized(*reference.add_rms_norm(x, residual, weight, eps), quant)

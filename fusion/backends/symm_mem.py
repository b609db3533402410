"""All-reduce through PyTorch symmetric memory (``torch.distributed._symmetric_memory``).

One buffer of ``max_tokens * hidden`` elements per TP group is allocated once and rendezvoused
on every rank (collective, before CUDA-graph capture; never multicast: the CUDA backend with
TORCH_SYMM_MEM_DISABLE_MULTICAST set uses peer-to-peer loads and stores over NVLink). A call
copies this rank's partial sum into the buffer, runs ``torch.ops.symm_mem.two_shot_all_reduce_``
(each rank reduces 1/world of the buffer reading every peer, then all-gathers: bandwidth-bound,
~311 GB/s per direction at 4096 x 4096 bf16 on H200) and copies the sum back to ``x``. Residual
add + RMSNorm then run as in the unfused path. Failures on any rank are voted over the CPU
group (`fusion.backends.symmetric_buffer`), so every rank keeps or drops the strategy together.

With ``deterministic`` (2 ranks only: `fusion.backends.deterministic`) the add + norm is the fused
kernels' row step (`fusion.backends.deterministic.add_rms_norm`): at 2 ranks torch's kernel adds each
element once, so the sum is the canonical one and the row's bits are the other strategies'.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from arfusion.fusion import norm
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
from arfusion.fusion.backends.symmetric_buffer import SymmetricBuffer
from arfusion.fusion.errors import FusionInputError
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.options import FLASHINFER
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy


class SymmMemTwoShotBackend(Backend):
    """torch symmetric-memory two-shot all-reduce, then add + RMSNorm

    The symmetric buffer of one TP group and the all-reduce + norm through it."""

    strategy = Strategy.SYMM_MEM_TWO_SHOT
    options = (FLASHINFER,)
    made = Made.ON_DEMAND
    det_max_world = 2
    det_note = ("torch's two-shot all-reduce adds more than two ranks in its own order, rounding to the model dtype at "
                "each step")
    cost: ClassVar[Costs] = {2: (12.002, 5.074, -0.001805)}
    tuned_at_startup = True

    def __init__(self, group: TensorParallelGroup, deterministic: bool = False) -> None:
        super().__init__(group)
        self.deterministic = deterministic
        self.symmetric = SymmetricBuffer(group, "symmetric-memory all-reduce")
        self.max_tokens = 0

    @classmethod
    def for_op(cls, context: BuildContext) -> SymmMemTwoShotBackend:
        return cls(context.group, context.deterministic)

    def _ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """Collective: a buffer of at least ``max_tokens * hidden`` elements of ``dtype`` on every
        rank; True on every rank or False on every rank. Refused during CUDA-graph capture."""
        ok = self.symmetric.ensure(max_tokens * hidden, dtype)
        self.failure = self.symmetric.failure
        self.max_tokens = self.symmetric.buffer.numel() // hidden if ok else 0
        return ok

    def rows(self) -> Rows:
        return Rows(1, self.max_tokens) if self.max_tokens else NO_ROWS

    @property
    def capacity(self) -> int:
        return self.max_tokens

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant: Quant | None = None) -> FusedOutput:
        """torch's two-shot all-reduce of ``x`` in place (through the buffer), then add + RMSNorm
        as `fusion.norm.add_rms_norm` does it (in place on GPU)."""
        buffer = self.symmetric.buffer
        if buffer is None or x.dtype != buffer.dtype or x.numel() > buffer.numel():
            raise FusionInputError(f"{self.strategy} cannot take {tuple(x.shape)} {x.dtype}: its buffer holds "
                                   f"{0 if buffer is None else buffer.numel()} elements")
        staged = buffer[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group.device_group.group_name)
        x.view(-1).copy_(staged)
        finish = deterministic.add_rms_norm if self.deterministic else norm.add_rms_norm
        out = FusedOutput(*finish(x, residual, weight, eps))
        return out if quant is None else quantized(out, quant)

    def _destroy(self) -> None:
        self.symmetric.destroy()
        self.max_tokens = 0

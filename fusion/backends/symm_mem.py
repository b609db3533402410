"""All-reduce through PyTorch symmetric memory (``torch.distributed._symmetric_memory``).

One buffer of ``max_tokens * hidden`` elements per TP group is allocated once and rendezvoused
on every rank (collective, before CUDA-graph capture; never multicast: the CUDA backend with
TORCH_SYMM_MEM_DISABLE_MULTICAST set uses peer-to-peer loads and stores over NVLink). A call
copies this rank's partial sum into the buffer, runs ``torch.ops.symm_mem.two_shot_all_reduce_``
(each rank reduces 1/world of the buffer reading every peer, then all-gathers: bandwidth-bound,
~311 GB/s per direction at 4096 x 4096 bf16 on H200) and copies the sum back to ``x``. Residual
add + RMSNorm then run as in the unfused path. Failures on any rank are voted over the CPU
group (`fusion.backends.symmetric_buffer`), so every rank keeps or drops the strategy together.
"""
from __future__ import annotations

from typing import Optional

import torch

from fusion.group import TensorParallelGroup
from fusion.backends.symmetric_buffer import SymmetricBuffer, symm_mem_unavailable_reason

__all__ = ["SymmMemAllReduce", "symm_mem_unavailable_reason"]


class SymmMemAllReduce:
    """The symmetric buffer of one TP group and the all-reduce through it."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.symmetric = SymmetricBuffer(group, "symmetric-memory all-reduce")

    @property
    def buffer(self) -> Optional[torch.Tensor]:
        return self.symmetric.buffer

    @property
    def failure(self) -> Optional[str]:
        return self.symmetric.failure

    def ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """Collective: a buffer of at least ``max_tokens * hidden`` elements of ``dtype`` on every
        rank; True on every rank or False on every rank. Refused during CUDA-graph capture."""
        return self.symmetric.ensure(max_tokens * hidden, dtype)

    def fits(self, x: torch.Tensor) -> bool:
        return self.buffer is not None and x.dtype == self.buffer.dtype and x.numel() <= self.buffer.numel()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (through the symmetric buffer); returns ``x``."""
        staged = self.buffer[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group.device_group.group_name)
        x.view(-1).copy_(staged)
        self.group.counters.total += 1
        return x

    def destroy(self) -> None:
        self.symmetric.destroy()

"""All-reduce through PyTorch symmetric memory (``torch.distributed._symmetric_memory``).

One buffer of ``max_tokens * hidden`` elements per TP group is allocated once and rendezvoused
on every rank (collective, before CUDA-graph capture; never multicast: the CUDA backend with
TORCH_SYMM_MEM_DISABLE_MULTICAST set uses peer-to-peer loads and stores over NVLink). A call
copies this rank's partial sum into the buffer, runs ``torch.ops.symm_mem.two_shot_all_reduce_``
(each rank reduces 1/world of the buffer reading every peer, then all-gathers: bandwidth-bound,
~311 GB/s per direction at 4096 x 4096 bf16 on H200) and copies the sum back to ``x``. Residual
add + RMSNorm then run as in the unfused path. Failures on any rank are voted over the CPU
group, so every rank keeps or drops the strategy together.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch

from fusion.group import TensorParallelGroup
from fusion.platform import is_capturing_cuda_graph

logger = logging.getLogger(__name__)


def symm_mem_unavailable_reason(device: torch.device) -> Optional[str]:
    """None when this process can run the symmetric-memory two-shot all-reduce on ``device``."""
    if device.type != "cuda":
        return f"symmetric memory needs a CUDA device, not {device}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        torch.ops.symm_mem.two_shot_all_reduce_  # noqa: B018 (the op exists in this build)
    except (ImportError, AttributeError, RuntimeError) as exc:
        return f"torch symmetric memory is not available ({type(exc).__name__}: {exc})"
    return None


class SymmMemAllReduce:
    """The symmetric buffer of one TP group and the all-reduce through it."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.buffer: Optional[torch.Tensor] = None
        self.handle: Any = None
        self.max_elements = 0
        self.failure: Optional[str] = None

    def ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """Collective: a buffer of at least ``max_tokens * hidden`` elements of ``dtype`` on every
        rank; True on every rank or False on every rank. Refused during CUDA-graph capture."""
        need = max_tokens * hidden
        if self.buffer is not None and self.buffer.dtype == dtype and need <= self.max_elements:
            return True
        if is_capturing_cuda_graph():
            raise RuntimeError("the symmetric-memory buffer cannot be allocated during CUDA-graph capture")
        reason = symm_mem_unavailable_reason(self.group.device)
        if reason is None:
            try:
                import torch.distributed._symmetric_memory as symm_mem

                enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed by older torch
                if enable is not None:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", FutureWarning)
                        enable(self.group.device_group.group_name)
                buffer = symm_mem.empty(need, dtype=dtype, device=self.group.device)
                self.handle = symm_mem.rendezvous(buffer, self.group.device_group)
                self.buffer, self.max_elements = buffer, need
            except Exception as exc:  # any failure must reach the other ranks through the vote
                reason = f"{type(exc).__name__}: {exc}"
        reasons = self.group.all_gather_object(reason)
        failed = {r: why for r, why in enumerate(reasons) if why}
        if failed:
            self.failure = "; ".join(f"rank {r}: {why}" for r, why in failed.items())
            self.destroy()
            if self.group.rank == 0:
                logger.warning("symmetric-memory all-reduce unavailable: %s", self.failure)
            return False
        return True

    def fits(self, x: torch.Tensor) -> bool:
        return self.buffer is not None and x.dtype == self.buffer.dtype and x.numel() <= self.max_elements

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (through the symmetric buffer); returns ``x``."""
        staged = self.buffer[: x.numel()]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group.device_group.group_name)
        x.view(-1).copy_(staged)
        self.group.counters.total += 1
        return x

    def destroy(self) -> None:
        self.buffer, self.handle, self.max_elements = None, None, 0

"""`SymmetricBuffer`: one torch symmetric-memory allocation of a TP group, made together.

``torch.distributed._symmetric_memory.empty`` + ``rendezvous`` on every rank (collective,
before CUDA-graph capture). The CUDA backend maps every peer's buffer into this process over
NVLink; ``peer_ptrs`` holds their addresses for kernels that load and store to peers directly.
Multicast is never used (the environment sets TORCH_SYMM_MEM_DISABLE_MULTICAST on NVLink
machines without it). Any failure on any rank is voted over the CPU group, so every rank keeps
or drops the buffer together; the reason is kept in ``failure``.
"""
from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch

from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.platform import is_capturing_cuda_graph
from arfusion.fusion.voting import voted_failure

logger = logging.getLogger(__name__)
# A barrier whose peer has not arrived after this long traps on the device ("[FATAL]
# CUDASymmetricMemory::barrier ..."), so a rank that died or took another path fails this
# process loudly instead of spinning forever (0 would wait without end). Far above any
# legitimate skew between ranks (a first Triton compile takes about a second).
BARRIER_TIMEOUT_MS = 120_000


def symm_mem_unavailable_reason(device: torch.device) -> Optional[str]:
    """None when this process can allocate symmetric memory and run torch's symm-mem ops on ``device``."""
    if device.type != "cuda":
        return f"symmetric memory needs a CUDA device, not {device}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        torch.ops.symm_mem.two_shot_all_reduce_  # noqa: B018 (the op exists in this build)
    except (ImportError, AttributeError, RuntimeError) as exc:
        return f"torch symmetric memory is not available ({type(exc).__name__}: {exc})"
    return None


class SymmetricBuffer:
    """A symmetric buffer of at least the requested size on every rank of ``group``, or none."""

    def __init__(self, group: TensorParallelGroup, purpose: str) -> None:
        self.group = group
        self.purpose = purpose  # for log and error messages
        self.buffer: Optional[torch.Tensor] = None
        self.handle: Any = None
        self.peer_ptrs: Optional[torch.Tensor] = None  # [world] int64 on the device: each rank's buffer address
        self.failure: Optional[str] = None

    def ensure(self, elements: int, dtype: torch.dtype, extra_check: Optional[str] = None) -> bool:
        """Collective: a buffer of ``elements`` of ``dtype`` (grown if smaller; same dtype) on
        every rank. True on every rank or False on every rank. ``extra_check``: a reason this
        rank cannot use the buffer (voted like an allocation failure). Refused during capture."""
        if self.buffer is not None and self.buffer.dtype == dtype and elements <= self.buffer.numel():
            return True
        if is_capturing_cuda_graph():
            raise RuntimeError(f"the {self.purpose} symmetric buffer cannot be allocated during CUDA-graph capture")
        self.destroy()

        def allocate() -> Optional[str]:
            reason = extra_check or symm_mem_unavailable_reason(self.group.device)
            if reason is None:
                self._allocate(elements, dtype)
            return reason

        failure = voted_failure(self.group, allocate)
        if failure:
            self.failure = failure
            self.destroy()
            if self.group.rank == 0:
                logger.warning("%s unavailable: %s", self.purpose, self.failure)
            return False
        self.failure = None
        return True

    def _allocate(self, elements: int, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed by older torch
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group.device_group.group_name)
        buffer = symm_mem.empty(elements, dtype=dtype, device=self.group.device)
        handle = symm_mem.rendezvous(buffer, self.group.device_group)
        ptrs = [handle.get_buffer(r, (elements,), dtype).data_ptr() for r in range(self.group.world_size)]
        if ptrs[self.group.rank] != buffer.data_ptr():
            raise RuntimeError(f"symmetric handle maps this rank's buffer at {ptrs[self.group.rank]:#x}, "
                               f"not at the tensor's {buffer.data_ptr():#x}")
        self.buffer, self.handle = buffer, handle
        self.peer_ptrs = torch.tensor(ptrs, dtype=torch.int64, device=self.group.device)

    def barrier(self) -> None:
        """Every rank's previous work on this stream (its stores to peers included) is done
        and visible before any rank's next kernel on its stream runs. Capturable. Traps after
        BARRIER_TIMEOUT_MS without every peer."""
        self.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)

    def destroy(self) -> None:
        self.buffer, self.handle, self.peer_ptrs = None, None, None

"""`SymmMemCollectives`: a CUDA-graph-capturable stand-in for NCCL's all-reduce and all-gather,
over torch symmetric memory, for TP ranks that share a GPU.

There the device group is gloo (NCCL refuses two ranks on one device), whose collectives copy
through the host and cannot be captured, so decode would run without CUDA graphs. Torch
symmetric memory maps the ranks' buffers into each other with overlapping devices allowed
(TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES, set by the TP group in that mode). One buffer of
``max_bytes`` per rank, made together (`enable_capturable_collectives`, before capture); a call:

    all_reduce(x):        my buffer <- x;  barrier;  x <- round(0 + buf_0 + ... + buf_{N-1})
                          (fp32, rank order, one rounding: the canonical sum of
                          fusion/reference.py, which at 2 ranks is also NCCL's and gloo's);  barrier
    all_gather_into(o,x): my buffer <- x;  barrier;  o[r] <- buf_r for every rank r;  barrier

The first barrier makes every rank's copy visible before any rank reads it; the second keeps
a rank from overwriting its buffer (next call) while a peer still reads it. Only torch copies,
adds and the symmetric handle's barrier (each capturable): no host sync. Made for correctness
on one GPU, not for speed (N reads of the whole message per rank). A tensor larger than the
buffer goes through the device group as before (eager steps only: capture never sees one, as
the buffer is sized for the largest captured batch).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from arfusion.fusion.backends.symmetric_buffer import SymmetricBuffer
from arfusion.fusion.group import TensorParallelGroup

logger = logging.getLogger(__name__)
ALIGN = 16  # bytes: the buffer is a whole number of 16-byte words


class SymmMemCollectives:
    """All-reduce (sum) and all-gather of one TP group through one symmetric buffer."""

    def __init__(self, group: TensorParallelGroup) -> None:
        self.group = group
        self.symmetric = SymmetricBuffer(group, "capturable all-reduce / all-gather")
        self.capacity = 0  # bytes per rank
        self._peers: list[torch.Tensor] = []  # every rank's buffer as uint8, mapped here

    def ensure(self, max_bytes: int) -> bool:
        """Collective: buffers of at least ``max_bytes`` on every rank; True on every rank or on
        none (``symmetric.failure`` then says why). Refused during CUDA-graph capture."""
        size = -(-max(max_bytes, ALIGN) // ALIGN) * ALIGN
        if not self.symmetric.ensure(size, torch.uint8):
            self.capacity, self._peers = 0, []
            return False
        buffer = self.symmetric.buffer
        self.capacity = buffer.numel()
        self._peers = [self.symmetric.handle.get_buffer(r, (self.capacity,), torch.uint8)
                       for r in range(self.group.world_size)]
        return True

    def fits(self, x: torch.Tensor) -> bool:
        """A CUDA tensor of at most ``capacity`` bytes on a ready buffer."""
        return self.capacity > 0 and x.is_cuda and x.numel() * x.element_size() <= self.capacity

    def _stage(self, x: torch.Tensor) -> int:
        """Copies ``x`` into this rank's buffer, then the first barrier; returns its element count."""
        n = x.numel()
        self._peers[self.group.rank][: n * x.element_size()].view(x.dtype).copy_(x.reshape(-1))
        self.symmetric.barrier()
        return n

    def _peer(self, rank: int, x: torch.Tensor, n: int) -> torch.Tensor:
        return self._peers[rank][: n * x.element_size()].view(x.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` becomes the rank-order fp32 sum of every rank's ``x``, rounded once (in place); returns ``x``."""
        n = self._stage(x)
        acc = torch.zeros(n, dtype=torch.float32, device=x.device)
        for rank in range(self.group.world_size):
            acc += self._peer(rank, x, n)
        x.copy_(acc.view(x.shape))
        self.symmetric.barrier()
        return x

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (``[N * x.shape[0], ...]``) receives every rank's ``x`` in rank order; returns ``out``."""
        n = self._stage(x)
        rows = out.view(self.group.world_size, -1)
        for rank in range(self.group.world_size):
            rows[rank].copy_(self._peer(rank, x, n))
        self.symmetric.barrier()
        return out

    def destroy(self) -> None:
        self.symmetric.destroy()
        self.capacity, self._peers = 0, []


def enable_capturable_collectives(group: TensorParallelGroup, max_bytes: int) -> Optional[str]:
    """Collective: give ``group`` a `SymmMemCollectives` of ``max_bytes`` per rank (its
    ``all_reduce`` and ``all_gather_into`` then take CUDA tensors up to that size through it).
    Returns None when every rank has it, else why no rank does (the same on every rank)."""
    if group.world_size == 1:
        return None
    if group.capturable is not None:  # the group's, made once: graphs captured earlier point into it
        held = getattr(group.capturable, "capacity", 0)
        return None if held >= max_bytes else (f"the group's capturable buffer holds {held} bytes, made for an "
                                               f"earlier model; {max_bytes} are needed")
    collectives = SymmMemCollectives(group)
    if not collectives.ensure(max_bytes):
        return collectives.symmetric.failure or "the symmetric buffer could not be made"
    group.capturable = collectives
    return None


def disable_capturable_collectives(group: TensorParallelGroup) -> None:
    """Free the group's stand-in (on this rank; call on every rank, before the process groups go)."""
    if isinstance(group.capturable, SymmMemCollectives):
        group.capturable.destroy()
    group.capturable = None

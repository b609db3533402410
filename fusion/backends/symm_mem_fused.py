"""`SymmMemFusedAllReduceNorm`: all-reduce + residual add + RMSNorm as our own two-shot kernels
over one symmetric buffer per TP group (the ``symm_mem_fused`` strategy).

The math and the two launches are in `fusion.backends.kernels.two_shot_norm`; this module sizes the
buffer, cuts the tokens into shards and runs launch 1, barrier, launch 2 on the current stream
(CUDA-graph capturable once the buffer exists).

Buffer: ``world * S_max * hidden`` elements of the model dtype of scatter slots, then
``max_tokens * hidden`` of gathered rows, then (from the next 4-byte boundary) ``max_tokens``
int32 ready flags, zeroed when the buffer is made, ``S_max = ceil(max_tokens / world)``. A
batch of more than ``max_tokens`` rows runs as consecutive chunks of at most ``max_tokens``
rows (every step of the op is row-wise), so the buffer bounds memory, not the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from arfusion.fusion.backends.base import (
    NO_ROWS,
    Backend,
    Costs,
    Made,
    Rows,
    output_tensors,
    quantized,
)
from arfusion.fusion.backends.kernels import row_kernel_unavailable_reason
from arfusion.fusion.backends.symmetric_buffer import SymmetricBuffer
from arfusion.fusion.errors import FusionInputError
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.options import FLASHINFER
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy


@dataclass(frozen=True)
class ShardLayout:
    """Rank ``rank`` of ``world`` owns rows ``[own_start, own_start + own_rows)`` of ``tokens``
    (contiguous shards of ``shard_rows = ceil(tokens / world)``; the last ones may be short or empty)."""

    tokens: int
    world: int
    rank: int

    @property
    def shard_rows(self) -> int:
        return math.ceil(self.tokens / self.world)

    @property
    def own_start(self) -> int:
        return min(self.rank * self.shard_rows, self.tokens)

    @property
    def own_rows(self) -> int:
        return min(self.tokens, self.own_start + self.shard_rows) - self.own_start

    @property
    def peer_rows(self) -> int:
        return self.tokens - self.own_rows


def gather_offset(max_tokens: int, hidden: int, world: int) -> int:
    """Element offset of the gathered rows."""
    return world * math.ceil(max_tokens / world) * hidden


def flags_offset(max_tokens: int, hidden: int, world: int, element_size: int) -> int:
    """int32 offset of the ready flags: the first 4-byte boundary after the gathered rows."""
    data_bytes = (gather_offset(max_tokens, hidden, world) + max_tokens * hidden) * element_size
    return math.ceil(data_bytes / 4)


def buffer_elements(max_tokens: int, hidden: int, world: int, element_size: int) -> int:
    """Elements of the model dtype for scatter slots, gathered rows and flags (module docstring)."""
    flags_end = (flags_offset(max_tokens, hidden, world, element_size) + max_tokens) * 4
    return math.ceil(flags_end / element_size)


def row_chunks(tokens: int, max_tokens: int) -> list[slice]:
    """Consecutive row ranges of at most ``max_tokens`` rows covering ``tokens``."""
    return [slice(start, min(start + max_tokens, tokens)) for start in range(0, tokens, max_tokens)]


def fused_unavailable_reason(hidden: int) -> str | None:
    """None when the Triton kernels can run a row of ``hidden`` elements here."""
    return row_kernel_unavailable_reason(hidden, "the fused two-shot kernel")


def push_shards(x: torch.Tensor, peer_ptrs: torch.Tensor, layout: ShardLayout) -> None:
    """Launch 1: this rank's rows of every other shard into their owners' slot ``rank``."""
    from arfusion.fusion.backends.kernels.row_norm import row_block, row_num_warps
    from arfusion.fusion.backends.kernels.two_shot_norm import push_shards_kernel

    hidden = x.shape[1]
    if layout.peer_rows:
        push_shards_kernel[(layout.peer_rows,)](
            x, peer_ptrs, layout.rank, hidden, layout.shard_rows, layout.own_start, layout.own_rows,
            BLOCK=row_block(hidden), num_warps=row_num_warps(hidden))


def reduce_and_finish(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                      residual_out: torch.Tensor, weight: torch.Tensor, eps: float, peer_ptrs: torch.Tensor,
                      layout: ShardLayout, gather_at: int, flags_at: int) -> None:
    """Launch 2: sum this rank's shard, push it with its flags to every peer and add + norm it
    here; add + norm each peer row once its owner's flag is up."""
    from arfusion.fusion.backends.kernels.row_norm import row_block, row_num_warps
    from arfusion.fusion.backends.kernels.two_shot_norm import reduce_and_finish_kernel

    hidden = x.shape[1]
    reduce_and_finish_kernel[(layout.tokens,)](
        x, residual if residual is not None else x, out, residual_out, weight, peer_ptrs, layout.rank, hidden,
        layout.shard_rows, layout.own_start, layout.own_rows, gather_at, flags_at, eps, WORLD=layout.world,
        HAS_RESIDUAL=residual is not None, BLOCK=row_block(hidden), num_warps=row_num_warps(hidden))


class SymmMemFusedBackend(Backend):
    """our Triton two-shot over symmetric memory with add + RMSNorm fused

    The fused two-shot all-reduce + residual + RMSNorm of one TP group."""

    strategy = Strategy.SYMM_MEM_FUSED
    options = (FLASHINFER,)
    made = Made.ON_DEMAND
    made_det = Made.PRIMARY
    symm_rows = True
    cost: ClassVar[Costs] = {2: (9.243, 3.606, -0.000408)}
    fallback_rank = 2
    tuned_at_startup = True

    def __init__(self, group: TensorParallelGroup) -> None:
        super().__init__(group)
        self.symmetric = SymmetricBuffer(group, "fused two-shot all-reduce + RMSNorm")
        self.max_tokens = 0
        self.hidden = 0

    @property
    def ready(self) -> bool:
        return self.symmetric.buffer is not None

    @property
    def capacity(self) -> int:
        return self.max_tokens

    def _ensure(self, max_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        """Collective: the buffer for ``max_tokens`` rows of ``hidden`` on every rank; True on
        every rank or False on every rank. Refused during CUDA-graph capture."""
        if self.ready and self.symmetric.buffer.dtype == dtype and hidden == self.hidden and max_tokens <= self.max_tokens:
            return True
        world = self.group.world_size
        size = dtype.itemsize
        ok = self.symmetric.ensure(buffer_elements(max_tokens, hidden, world, size), dtype,
                                   fused_unavailable_reason(hidden))
        self.failure = self.symmetric.failure
        self.max_tokens, self.hidden = (max_tokens, hidden) if ok else (0, 0)
        if ok:  # every flag down before any peer can raise one (after the next call's barrier)
            start = flags_offset(max_tokens, hidden, world, size) * 4
            self.symmetric.buffer.view(torch.uint8)[start:start + 4 * max_tokens].zero_()
        return ok

    def rows(self) -> Rows:
        """Any number of rows once the buffer exists: a batch beyond it runs in chunks (every
        step of the op is row-wise)."""
        return Rows(1, None) if self.ready else NO_ROWS

    def run(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant: Quant | None = None) -> FusedOutput:
        """``(rms_norm(sum(x) + residual), sum(x) + residual)`` over the group; ``x`` and
        ``residual`` are overwritten (see `output_tensors`); runs in chunks of at most
        ``max_tokens`` rows."""
        if not self.ready or x.dtype != self.symmetric.buffer.dtype or x.shape[1] != self.hidden:
            raise FusionInputError(f"{self.strategy} cannot take {tuple(x.shape)} {x.dtype}: its buffer is for "
                                   f"hidden {self.hidden or 'none'}, "
                                   f"{self.symmetric.buffer.dtype if self.ready else 'no buffer'}")
        out, residual_out = output_tensors(x, residual)
        for rows in row_chunks(x.shape[0], self.max_tokens):
            self._run_chunk(x[rows], None if residual is None else residual[rows], out[rows], residual_out[rows],
                            weight, eps)
        result = FusedOutput(out, residual_out)
        return result if quant is None else quantized(result, quant)

    def _run_chunk(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                   residual_out: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
        """The two launches for at most ``max_tokens`` rows (contiguous row slices)."""
        world = self.group.world_size
        layout = ShardLayout(x.shape[0], world, self.group.rank)
        gather_at = gather_offset(self.max_tokens, self.hidden, world)
        flags_at = flags_offset(self.max_tokens, self.hidden, world, x.element_size())
        ptrs = self.symmetric.peer_ptrs
        push_shards(x, ptrs, layout)
        self.symmetric.barrier()
        reduce_and_finish(x, residual, out, residual_out, weight, eps, ptrs, layout, gather_at, flags_at)

    def _destroy(self) -> None:
        self.symmetric.destroy()
        self.max_tokens = self.hidden = 0

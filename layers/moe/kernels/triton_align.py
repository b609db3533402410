"""`align_by_expert` (layers/moe/align.py) in one Triton launch of one program, for decode-sized
routings: the torch version is some twenty small launches, this one is one.

The program walks the slots in chunks of CHUNK, each chunk as a ``[CHUNK, E]`` one-hot of its
expert ids:

    counts[e]      = number of slots of expert e                 (a sum over the one-hots)
    start[e]       = sum over e' < e of ceil(counts[e'] / BLOCK_M) * BLOCK_M
    block_expert[b] = min(number of e with start[e] + padded[e] <= b * BLOCK_M, E - 1)
    sorted_slots   = N everywhere, then (after a CTA barrier) slot s written to row
                     start[e_s] + (slots of e_s before s): earlier chunks' count of e_s plus
                     this chunk's, from a cumulative sum of the one-hot down the chunk

which is `align_by_expert`'s result exactly (slots increasing within each expert). Work grows
with N * E / CHUNK, so `fused_moe` takes it up to `MAX_SLOTS` slots and the torch version above.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from arfusion.layers.moe.align import ExpertBlocks, max_padded_rows

MAX_SLOTS = 2048  # batch 256 at top-8
TILE_ELEMENTS = 4096  # CHUNK * next_power_of_2(E): one-hot tiles of 32 registers per thread at 4 warps


@triton.jit
def _align_kernel(ids_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr, num_slots, num_experts, max_rows,
                  max_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, num_slots, CHUNK):
        ids = tl.load(ids_ptr + c0 + lanes, mask=c0 + lanes < num_slots, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    tl.store(num_rows_ptr, tl.sum(padded, axis=0))
    real = experts < num_experts
    for b0 in range(0, max_blocks, CHUNK):
        first_rows = (b0 + lanes) * BLOCK_M
        before = tl.sum(((padded_end[None, :] <= first_rows[:, None]) & real[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b0 + lanes, tl.minimum(before, num_experts - 1), mask=b0 + lanes < max_blocks)
    for r0 in range(0, max_rows, CHUNK):
        tl.store(sorted_slots_ptr + r0 + lanes, tl.zeros([CHUNK], dtype=tl.int32) + num_slots, mask=r0 + lanes < max_rows)
    tl.debug_barrier()  # every sentinel is written before any slot overwrites one
    next_row = padded_end - padded  # start[e], then advanced past the slots already placed
    for c0 in range(0, num_slots, CHUNK):
        slots = c0 + lanes
        ids = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        rows = tl.sum(onehot * (next_row[None, :] + tl.cumsum(onehot, axis=0) - 1), axis=1)
        tl.store(sorted_slots_ptr + rows, slots, mask=slots < num_slots)
        next_row += tl.sum(onehot, axis=0)


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`layers.moe.align.align_by_expert` in one launch (module docstring); the same tensors,
    equal element for element. No host synchronisation."""
    flat = topk_ids.flatten().to(torch.int32)
    num_slots = flat.numel()
    max_rows = max_padded_rows(num_slots, num_experts, block_m)
    sorted_slots = torch.empty(max_rows, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=flat.device)
    num_rows = torch.empty(1, dtype=torch.int32, device=flat.device)
    block_e = triton.next_power_of_2(num_experts)
    chunk = max(16, TILE_ELEMENTS // block_e)
    _align_kernel[(1,)](flat, sorted_slots, block_expert, num_rows, num_slots, num_experts, max_rows,
                        block_expert.numel(), BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, num_warps=4)
    return ExpertBlocks(sorted_slots, block_expert, num_rows, block_m)

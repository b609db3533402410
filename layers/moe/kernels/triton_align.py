"""`align_by_expert` (layers/moe/align.py) in one Triton launch of one program per expert: the
torch version is some twenty small launches, this one is one, and no program waits for another.

Program e reads every slot's expert id (from L2 after the first program) and computes, itself,
what it needs of the whole grouping:

    counts[e']  = number of slots of expert e'       (a histogram of the ids, chunk by chunk)
    padded[e']  = ceil(counts[e'] / BLOCK_M) * BLOCK_M
    start[e]    = sum over e' < e of padded[e'];   total = sum over all e' of padded[e']

then writes only its own rows and blocks: slot s of expert e (in increasing s) to row
start[e] + (slots of e before s), a cumulative sum of ``ids == e`` down the slots; the sentinel N
to rows [start[e] + counts[e], start[e] + padded[e]); e to blocks [start[e], start[e] + padded[e])
/ BLOCK_M. The rows and blocks past ``total`` (sentinel N, expert E - 1) are shared out among the
programs. Every row and block is written by exactly one program, so no barrier or order between
programs is needed, which is `align_by_expert`'s result exactly.

Why per-expert programs and not one program: one program walking the slots in chunks of a
[CHUNK, E] one-hot (this file's earlier form) took 14.3 us at 256 slots of 128 experts against
2.7 here (1 x H100 80GB, docs/results.md), a serial chain of cross-thread scans; here each program's chain is a
histogram and one scan per 1,024 slots. Work grows with N * E (every program reads every id),
so `fused_moe` takes it up to `MAX_SLOTS` slots (the largest count timed) and the torch version above.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from arfusion.layers.moe.align import ExpertBlocks, max_padded_rows

MAX_SLOTS = 32768  # 4,096 tokens at top-8: 61 against the torch version's 122 us (docs/results.md)
MAX_CHUNK = 1024  # slots a program takes at once: 8 per thread at 4 warps
MIN_CHUNK = 128  # one slot per thread at 4 warps; smaller inputs are masked lanes of one chunk
MIN_BINS = 32  # histogram bins: at least a warp's width


@triton.jit
def _align_kernel(ids_ptr, sorted_slots_ptr, block_expert_ptr, num_rows_ptr, num_slots, num_experts, max_rows,
                  max_blocks, BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr):
    expert = tl.program_id(0)
    programs = tl.num_programs(0)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, num_slots, CHUNK):
        # masked lanes and ids outside [0, E) count in bin E, which no expert reads (BINS > E)
        ids = tl.load(ids_ptr + c0 + lanes, mask=c0 + lanes < num_slots, other=num_experts)
        counts += tl.histogram(tl.where((ids >= 0) & (ids < num_experts), ids, num_experts), BINS)
    bins = tl.arange(0, BINS)
    padded = tl.where(bins < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    total = tl.sum(padded, axis=0)
    start = tl.sum(tl.where(bins < expert, padded, 0), axis=0)
    count = tl.sum(tl.where(bins == expert, counts, 0), axis=0)
    end = start + tl.sum(tl.where(bins == expert, padded, 0), axis=0)
    placed = start
    for c0 in range(0, num_slots, CHUNK):
        slots = c0 + lanes
        mine = tl.load(ids_ptr + slots, mask=slots < num_slots, other=-1) == expert
        taken = mine.to(tl.int32)
        tl.store(sorted_slots_ptr + placed + tl.cumsum(taken, axis=0) - taken, slots, mask=mine)
        placed += tl.sum(taken, axis=0)
    pad = tl.arange(0, BLOCK_M)  # fewer than BLOCK_M padding rows
    tl.store(sorted_slots_ptr + start + count + pad, tl.zeros([BLOCK_M], dtype=tl.int32) + num_slots,
             mask=start + count + pad < end)
    for b0 in range(start // BLOCK_M, end // BLOCK_M, CHUNK):
        tl.store(block_expert_ptr + b0 + lanes, tl.zeros([CHUNK], dtype=tl.int32) + expert,
                 mask=b0 + lanes < end // BLOCK_M)
    for r0 in range(total + expert * CHUNK, max_rows, programs * CHUNK):
        tl.store(sorted_slots_ptr + r0 + lanes, tl.zeros([CHUNK], dtype=tl.int32) + num_slots,
                 mask=r0 + lanes < max_rows)
    for b0 in range(total // BLOCK_M + expert * CHUNK, max_blocks, programs * CHUNK):
        tl.store(block_expert_ptr + b0 + lanes, tl.zeros([CHUNK], dtype=tl.int32) + num_experts - 1,
                 mask=b0 + lanes < max_blocks)
    if expert == 0:
        tl.store(num_rows_ptr, total)


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """`layers.moe.align.align_by_expert` in one launch of ``num_experts`` programs (module
    docstring); the same tensors, equal element for element. No host synchronisation, so ids
    are not checked: a slot whose id lies outside 0..E-1 gets no row (it never reaches a bin's
    shared-memory counter out of range)."""
    flat = topk_ids.flatten().to(torch.int32)
    num_slots = flat.numel()
    max_rows = max_padded_rows(num_slots, num_experts, block_m)
    sorted_slots = torch.empty(max_rows, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(max_rows // block_m, dtype=torch.int32, device=flat.device)
    num_rows = torch.empty(1, dtype=torch.int32, device=flat.device)
    bins = max(MIN_BINS, triton.next_power_of_2(num_experts + 1))
    chunk = min(MAX_CHUNK, max(MIN_CHUNK, triton.next_power_of_2(num_slots)))
    _align_kernel[(num_experts,)](flat, sorted_slots, block_expert, num_rows, num_slots, num_experts, max_rows,
                                  block_expert.numel(), BLOCK_M=block_m, BINS=bins, CHUNK=chunk, num_warps=4)
    return ExpertBlocks(sorted_slots, block_expert, num_rows, block_m)

"""Triton kernels of the fused two-shot all-reduce + residual add + RMSNorm over symmetric memory.

W ranks, T tokens, hidden H. Tokens are cut into W contiguous shards of S = ceil(T / W) rows;
rank r owns rows [r*S, min((r+1)*S, T)). Every rank's symmetric buffer holds W scatter slots of
S x H elements (slot s receives sender s's rows of this rank's shard), a gather region of
T x H elements (the reduced rows of every shard) and T int32 ready flags, one per row (0 at
allocation). Peers' buffers are reached by their virtual addresses (``peer_ptrs[q]``: rank q's
buffer, mapped here over NVLink by torch symmetric memory; plain loads, stores and atomics,
never multicast). One call is two launches with one barrier between them:

    1. push_shards:        for every row i of a shard s != r:  slot_r of rank s  <- x[i]   (remote store)
       barrier
    2. reduce_and_finish:  programs 0 .. own_rows-1, row i of my shard:
                               y_i = round(0 + row_0 + row_1 + ... + row_{W-1})   (fp32, rank
                                     order, one rounding; row_r = x[i], row_s = slot_s[i])
                               gather of every rank q != r [i] <- y_i              (remote store)
                               flag of every rank q != r [i] <- 1                  (release, system scope)
                               residual_out[i], out[i] = add_rms_norm(y_i, residual[i])
                           programs own_rows .. T-1, row i of a peer's shard:
                               wait until my flag[i] == 1, set it back to 0         (acquire, system scope)
                               y_i = gather[i]
                               residual_out[i], out[i] = add_rms_norm(y_i, residual[i])

The second half of launch 2 starts each peer row as soon as its owner has pushed it, so the
add + norm of the peers' rows (HBM traffic) overlaps the NVLink pushes, with no second barrier.
A waiting program only needs programs of lower ids (this rank's owners of rows, which never
wait) to have run, here and on the peers: blocks are dispatched in id order, so the waits
cannot deadlock. Ordering: a program's stores to a peer, a CTA barrier, then one thread's
release atomic on the peer's flag; the waiter's acquire atomic, a CTA barrier, then reads of
the gathered row that bypass the SM's L1 (``.cv``). Reuse across calls (and CUDA-graph
replays): a flag goes back to 0 when its row is read; the next call's owner sets it again only
after the next call's barrier, which this rank reaches after this launch has finished. The same
barrier orders the next call's scatter and gather stores after this call's reads: a rank's
launch 2 ends only after every peer's owning programs, which read their scatter slots before
raising the flags, have run.

with add_rms_norm the reference math (fusion/reference.py): ``res = round(y + residual)`` (fp32
add, one rounding; ``res = y`` without a residual), ``out = round(res / RMS(res) * weight)`` in
fp32. Each row is summed once, by its owner, and the same bf16/fp16 ``y_i`` reaches every rank,
so all ranks return identical outputs. ``y_i`` is the canonical sum of fusion/reference.py (rank
order, whichever rank owns the row), which at W = 2 is also what an NCCL all-reduce returns.

Traffic per rank: (W-1)/W of x out in launch 1 and (W-1)/W of the reduced rows out in launch 2
(each over NVLink, as in any two-shot all-reduce), and no copy of x into the symmetric buffer:
the pushes read x where the GEMM left it.

Why our own kernels: no library offers reduce-scatter + residual + RMSNorm + all-gather over
symmetric memory with the norm fused (flashinfer's two-shot kernel uses its own IPC workspace
and loses to its one-shot below ~4k tokens; torch's ``two_shot_all_reduce_`` needs the input
copied into and out of its buffer, and the norm as a third pass).

Programs: one per row (the row's H elements in one block, H <= MAX_HIDDEN), so the norm needs
no second pass over memory. ``x``, ``residual``, ``out`` and ``residual_out`` are contiguous
[T, H]; ``out`` may be ``x`` (launch 2 reads a row of x before writing it; launch 1 only reads
rows that launch 2 of the same rank writes after the barrier).
"""
from __future__ import annotations

import triton
import triton.language as tl

from arfusion.fusion.backends.kernels.row_norm import add_rms_norm_row


@triton.jit
def _peer_row(peer_ptrs, rank, offset, elem_ty: tl.constexpr):
    """Pointer to element ``offset`` of rank ``rank``'s symmetric buffer (16-byte aligned, as
    every symmetric allocation is: the hint lets row accesses use 128-bit loads and stores)."""
    base = tl.multiple_of(tl.load(peer_ptrs + rank).to(tl.pointer_type(elem_ty)), 16)
    return base + offset


@triton.jit
def push_shards_kernel(x_ptr, peer_ptrs, rank, hidden, shard_rows, own_start, own_rows,
                       BLOCK: tl.constexpr):
    """Launch 1. Program p handles the p-th row outside [own_start, own_start + own_rows)."""
    pid = tl.program_id(0).to(tl.int64)
    row = tl.where(pid < own_start, pid, pid + own_rows)
    owner = row // shard_rows
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    elem_ty = x_ptr.dtype.element_ty
    dst = _peer_row(peer_ptrs, owner, (rank * shard_rows + row - owner * shard_rows) * hidden, elem_ty)
    tl.store(dst + cols, tl.load(x_ptr + row * hidden + cols, mask=mask), mask=mask)


@triton.jit
def _flag(peer_ptrs, rank, flags_at, row):
    """Pointer to rank ``rank``'s ready flag of ``row`` (int32 element ``flags_at + row`` of its buffer)."""
    return tl.load(peer_ptrs + rank).to(tl.pointer_type(tl.int32)) + flags_at + row


@triton.jit
def reduce_and_finish_kernel(x_ptr, residual_ptr, out_ptr, residual_out_ptr, weight_ptr, peer_ptrs, rank, hidden,
                             shard_rows, own_start, own_rows, gather_offset, flags_at, eps,
                             WORLD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Launch 2. Program p < own_rows reduces row own_start + p of this rank's shard, pushes it
    and raises its flags; program p >= own_rows waits for the (p - own_rows)-th row outside the
    shard and finishes it."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    elem_ty = x_ptr.dtype.element_ty
    if pid < own_rows:
        row = own_start + pid
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for sender in tl.static_range(WORLD):  # rank order from +0.0: the canonical sum (fusion.reference)
            if sender == rank:
                acc += tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                slot = _peer_row(peer_ptrs, rank, (sender * shard_rows + pid) * hidden, elem_ty)
                acc += tl.load(slot + cols, mask=mask, other=0.0).to(tl.float32)
        y = acc.to(elem_ty)
        for peer in tl.static_range(WORLD):
            if peer != rank:
                tl.store(_peer_row(peer_ptrs, peer, gather_offset + row * hidden, elem_ty) + cols, y, mask=mask)
        tl.debug_barrier()  # every thread's pushes precede the release below
        for peer in tl.static_range(WORLD):
            if peer != rank:
                tl.atomic_xchg(_flag(peer_ptrs, peer, flags_at, row), 1, sem="release", scope="sys")
    else:
        peer_index = pid - own_rows
        row = tl.where(peer_index < own_start, peer_index, peer_index + own_rows)
        while tl.atomic_cas(_flag(peer_ptrs, rank, flags_at, row), 1, 0, sem="acquire", scope="sys") != 1:
            pass
        tl.debug_barrier()  # the acquire precedes every thread's reads below
        gathered = _peer_row(peer_ptrs, rank, gather_offset + row * hidden, elem_ty)
        y = tl.load(gathered + cols, mask=mask, other=0.0, cache_modifier=".cv")
    add_rms_norm_row(y, row, residual_ptr, out_ptr, residual_out_ptr, weight_ptr, cols, mask, hidden, eps,
                      HAS_RESIDUAL)

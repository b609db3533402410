"""Decode attention that rotates its own query and writes the new key: the rotary embedding (with
Qwen3's per-head q/k RMSNorm when given) and the KV-cache write folded into the split kernel of
layers/kernels/triton_decode_attention.py, so that a decode step's attention is the split launch
(and the combine, with several splits) instead of the rotary launch and then those.

For sequence b of a decode batch (one new token at position p_b = positions[b], written to slot
slot_mapping[b], the row's key index n_b - 1 with n_b = seq_lens[b]), from the raw projections
q, k, v (rows of the packed q/k/v output):

    q_b       = rotary(norm_q(q[b]), p_b)            every query head, in the program's registers
    k_cache[slot_mapping[b]] = rotary(norm_k(k[b]), p_b),   v_cache[slot_mapping[b]] = v[b]
    out[b, h] = softmax(scale * q_b[h] . K_b^T) @ V_b       as the split kernel, over keys 0 .. n_b - 1

with layers/kernels/triton_rotary.py's math and roundings (`normed_rotation`: the halves in fp32,
rounded once to the dtype; this launch is compiled with FMA contraction off, as that one is), so
the cache receives the bits the rotary launch writes and each query equals the rotary launch's
output. Each program (b, kv head, split) rotates the G query heads it reads. The program whose
keys hold index n_b - 1 rotates that kv head's new key, stores it and the new value to the slot,
and takes them from its registers for that key index instead of reading the slot back (no
ordering between its own store and load is needed); no other program reads that index.

The attention part is the split kernel's (`chunk_bounds`, `attend_keys`, `finish_split`: the
combine in this launch or in its launch of its own, as the split kernel chooses): the same splits, the same sums in
the same order. Compiled without FMA contraction
it can round a score differently from the split kernel compiled with it, so the two paths agree
within rounding, not bit for bit; the KV cache does agree bit for bit.

Not for batch-invariant mode (its fixed key chunks); the caller keeps the rotary launch there.

Contract and effects: reads q, k, v (views with contiguous last dims, rows at any stride), the
caches and the index tensors; writes k_cache / v_cache at ``slot_mapping`` (in place: one slot a
row; a slot named twice ends up with one row's values, as with the rotary launch), a new output of
q's dtype, and the split kernel's fp32 scratch and arrival counters. Shapes only choose the launch, so a call is
CUDA-graph capturable.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from arfusion.layers.head_norm import HeadNorm
from arfusion.layers.kernels import pdl
from arfusion.layers.kernels.triton_decode_attention import (NUM_STAGES, NUM_WARPS, attend_keys, check_operands,
                                                             check_sinks, chunk_bounds, combine, dot_precision,
                                                             finish_split, group_pad, plan_splits)
from arfusion.layers.kernels.triton_rotary import check_store_kv, normed_rotation
from arfusion.layers.kernels.triton_slot_rows import sequence_slot_row


@triton.jit
def _rotated_heads(row, heads, rows_mask, cos, sin, norm_weight_ptr, eps, ROWS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, HAS_HEAD_NORM: tl.constexpr):
    """Heads ``heads [ROWS]`` of one token's raw projection at ``row`` (rows_mask off: zeros),
    normed and rotated by `normed_rotation` and rounded to the row's dtype: ``[ROWS, HEAD_DIM]``."""
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, half)
    offs = heads[:, None] * HEAD_DIM + cols[None, :]
    x1 = tl.load(row + offs, mask=rows_mask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(row + offs + half, mask=rows_mask[:, None], other=0.0).to(tl.float32)
    dtype = row.dtype.element_ty
    out1, out2 = normed_rotation(x1, x2, cos, sin, norm_weight_ptr, cols, eps, dtype, HEAD_DIM, HAS_HEAD_NORM)
    both = tl.reshape(tl.permute(tl.join(out1.to(dtype), out2.to(dtype)), (0, 2, 1)), (ROWS, HEAD_DIM))
    return tl.where(rows_mask[:, None], both, 0.0).to(dtype)  # rows past the group: 0, as a masked load


@triton.jit
def _rotary_split_kernel(Q, K, V, Positions, InvFreq, SlotMapping, QNorm, KNorm, eps, KCache, VCache,
                         ReqToToken, RowIds, SeqLens, PartOut, PartLse, Out, Arrivals, Sinks, qk_scale_log2,
                         stride_qb, stride_kb, stride_vb, stride_ks, stride_kh, stride_vs, stride_vh, stride_rb,
                         stride_ob, stride_oh, context, window,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, HAS_ROW_IDS: tl.constexpr, HAS_SINKS: tl.constexpr,
                         HAS_WINDOW: tl.constexpr, HAS_HEAD_NORM: tl.constexpr, SPLITS_PAD: tl.constexpr,
                         COMBINE_IN_SPLIT: tl.constexpr, USE_PDL: tl.constexpr):
    """Q, K, V: the raw projections' rows ([B, H*D], [B, KVH*D], [B, KVH*D] at their row
    strides); KCache / VCache the caches; the rest as the split kernel's. With USE_PDL only
    inv_freq is read before the wait for the previous kernel."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    cols = tl.arange(0, HEAD_DIM // 2)
    inv_freq = tl.load(InvFreq + cols)
    if USE_PDL:  # everything below reads the step's data (layers/kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq_len, start, end, ran = chunk_bounds(SeqLens, b, split, context, window, NUM_SPLITS, BLOCK, HAS_WINDOW, 0)
    if start < seq_len:
        angle = tl.load(Positions + b).to(tl.float32) * inv_freq
        cos = tl.cos(angle)
        sin = tl.sin(angle)
        offs_g = tl.arange(0, GROUP_PAD)
        heads = kvh * GROUP + offs_g
        g_mask = offs_g < GROUP
        q = _rotated_heads(Q + b * stride_qb, heads, g_mask, cos, sin, QNorm, eps, GROUP_PAD, HEAD_DIM, HAS_HEAD_NORM)
        one = tl.full([1], 0, tl.int32) + kvh
        new_k = _rotated_heads(K + b * stride_kb, one, one >= 0, cos, sin, KNorm, eps, 1, HEAD_DIM, HAS_HEAD_NORM)
        offs_d = tl.arange(0, HEAD_DIM)
        new_v = tl.load(V + b * stride_vb + kvh * HEAD_DIM + offs_d)[None, :]
        new_key = seq_len - 1
        if new_key < end:  # this program holds the new key: it writes the slot
            slot = tl.load(SlotMapping + b).to(tl.int64)
            tl.store(KCache + slot * stride_ks + kvh * stride_kh + offs_d[None, :], new_k)
            tl.store(VCache + slot * stride_vs + kvh * stride_vh + offs_d[None, :], new_v)
        slot_row = sequence_slot_row(ReqToToken, RowIds, b, stride_rb, HAS_ROW_IDS)
        m, l, acc = attend_keys(q, KCache, VCache, slot_row, kvh, heads, g_mask, split, Sinks, start, end,
                                qk_scale_log2, stride_ks, stride_kh, stride_vs, stride_vh, new_k, new_v, new_key,
                                GROUP_PAD, HEAD_DIM, BLOCK, DOT_PRECISION, HAS_SINKS, True)
        finish_split(PartOut, PartLse, Out, Arrivals, b, kvh, heads, g_mask, split, ran, m, l, acc, stride_ob,
                     stride_oh, GROUP_PAD, HEAD_DIM, NUM_HEADS, NUM_SPLITS, SPLITS_PAD, COMBINE_IN_SPLIT)


def decode_attention_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            inv_freq: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, req_to_token: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            head_norm: Optional[HeadNorm] = None, row_ids: Optional[torch.Tensor] = None,
                            sinks: Optional[torch.Tensor] = None, window: int = 0,
                            num_splits: Optional[int] = None, block: Optional[int] = None,
                            combine_in_split: Optional[bool] = None) -> torch.Tensor:
    """A decode batch's attention from its raw projections (module docstring): ``positions,
    slot_mapping, seq_lens [B]``, ``q [B, H*d]``, ``k, v [B, KVH*d]`` (one dtype, contiguous
    last dims), ``inv_freq [d/2]`` fp32 and ``head_norm`` as
    `triton_rotary.rotary_embedding_store_kv` takes them; the caches, ``req_to_token``,
    ``row_ids``, ``scale``, ``sinks``, ``window``, ``num_splits``, ``block`` and ``combine_in_split`` as
    `triton_decode_attention.decode_attention` takes them. Writes the new keys and values
    into the caches at ``slot_mapping`` (in place) and returns a new ``[B, H, d]`` of q's
    dtype. The checks are the two launches' own: ValueError naming the operand."""
    batch, head_dim, heads, kv_heads = check_store_kv(positions, q, k, v, inv_freq, slot_mapping, k_cache, v_cache,
                                                      head_norm)
    q_heads = q.unflatten(1, (heads, head_dim))
    check_operands(q_heads, k_cache, v_cache, req_to_token, seq_lens, row_ids)
    check_sinks(sinks, heads, q.device, window)
    context = req_to_token.shape[1]
    plan = plan_splits(q_heads, kv_heads, context, num_splits, block, None, window, combine_in_split)
    q_norm, k_norm, eps = head_norm if head_norm is not None else (inv_freq, inv_freq, 0.0)
    use_pdl = pdl.enabled()
    _rotary_split_kernel[(batch, kv_heads, plan.splits)](
        q, k, v, positions, inv_freq, slot_mapping, q_norm, k_norm, float(eps), k_cache, v_cache, req_to_token,
        seq_lens if row_ids is None else row_ids, seq_lens, plan.part_out, plan.part_lse, plan.out, plan.counters(),
        seq_lens if sinks is None else sinks, scale * math.log2(math.e),
        q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), req_to_token.stride(0), plan.out.stride(0), plan.out.stride(1), context, window,
        GROUP=heads // kv_heads, GROUP_PAD=group_pad(heads // kv_heads), HEAD_DIM=head_dim, NUM_HEADS=heads,
        NUM_SPLITS=plan.splits, BLOCK=plan.block, DOT_PRECISION=dot_precision(q.dtype),
        HAS_ROW_IDS=row_ids is not None, HAS_SINKS=sinks is not None, HAS_WINDOW=window > 0,
        HAS_HEAD_NORM=head_norm is not None, SPLITS_PAD=triton.next_power_of_2(plan.splits),
        COMBINE_IN_SPLIT=plan.arrivals is not None, USE_PDL=use_pdl, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        enable_fp_fusion=False, launch_pdl=use_pdl,
    )
    return combine(plan, seq_lens, context, window)

"""Decode attention over the token-slot KV cache in Triton: split-K ("flash-decoding").

One query per sequence. For sequence b, query head h (kv head kh = h // G, G = H / KVH) and its
keys and values K_b, V_b = k_cache / v_cache[req_to_token[r_b, :n_b], kh] (n_b = seq_lens[b];
r_b = row_ids[b] when row ids are given, else b):

    out[b, h] = softmax(scale * q[b, h] . K_b^T) @ V_b          (fp32 accumulation)

Row ids let a CUDA-graph runner pass its whole request table (one row per request slot) and the
batch's rows, instead of copying a gathered ``[B, C]`` table into a static buffer every step.

Split kernel, grid (B, KVH, NUM_SPLITS). A (B, KVH) grid alone would leave most SMs idle at
small batches, so the key range of each row is cut into NUM_SPLITS chunks, from seq_lens on the
device (no host sync):

    chunk_b = max(BLOCK, round_up(ceil(n_b / NUM_SPLITS), BLOCK)),  keys [s*chunk_b, min((s+1)*chunk_b, n_b))

A program whose chunk starts at or past n_b exits at once and writes nothing. A program loads
the G query heads that share its kv head (every K/V row is read once for all G heads), padded
to GROUP_PAD = max(16, next_pow2(G)) rows so that q.K^T and p.V are ``tl.dot`` tensor-core
products (tl.dot needs M >= 16), and runs the online softmax over blocks of BLOCK keys in base
2 (x = scale*log2(e)*q.k, exp2 for exp): running max m, running sum l = sum_j 2^(x_j - m),
running acc = sum_j 2^(x_j - m) v_j, rescaled by 2^(m_old - m_new) when the max grows. With
NUM_SPLITS = 1 it writes out = acc / l itself and there is no combine. Otherwise it stores the
normalised partial output o_s = acc_s / l_s and its log-sum-exp lse_s = m_s + log2(l_s).

Combine, over the ran_b = ceil(n_b / chunk_b) <= NUM_SPLITS splits that ran. Since
2^(lse_s) = sum_{j in s} 2^(x_j):

    out = sum_s w_s o_s / sum_s w_s,      w_s = 2^(lse_s - M),  M = max_s lse_s

(every w_s lies in (0, 1] and one is 1: no overflow, no 0/0). Where a kv head serves at least
COMBINE_IN_SPLIT_MIN_GROUP query heads (`combine_in_split_for`; ``combine_in_split`` overrides) it
runs in the split launch itself: a row that one split covers (ran_b = 1) writes acc / l at once;
otherwise each of its splits stores its partial and counts its arrival on the (sequence, kv
head) counter (layers/kernels/arrival_counters.py), and the last of the ran_b to arrive combines
the G heads at once, adding the splits 0, 1, ... in order. Otherwise the combine is a launch of
its own, grid (B, H), one program per head summing the splits as a tree (the same math; the
sums' rounding may differ).

Batch-invariant mode passes ``keys_per_split``: chunk_b is that fixed size, so row b takes
ceil(n_b / keys_per_split) splits (fewer for short rows, more for long ones; never a function
of the batch), the grid is ceil(C / keys_per_split) splits, and the combine adds splits 0, 1,
... in order (a loop, not a tree over the grid's padded split count, in either form of the
combine), so a row's bits depend on its own keys only.

Launch choice (`choose_launch`), from shapes only (B, KVH, the keys a row can hold: the width C
of req_to_token, or a window W narrower than it, and the SM count): floor(WAVES * SMs / (B * KVH))
splits of BLOCK_N keys, i.e. about WAVES programs per SM, at most one split per block of C (of W:
a layer with a window of 256 keys takes 4 splits of 64, not one per block of a long context's
C, which would leave all but four empty), between 1 and MAX_SPLITS; mid-size batches
(MID_MIN_ROWS <= B * KVH <= MID_WAVES * SMs) take MID_BLOCK_N-key blocks and about MID_WAVES
programs per SM instead. A span of at most SHORT_SPAN keys (a window of 128, a short context)
takes one split of one block at any batch: no partials, no combine, and one program's
latency instead of a split's plus the combine's (docs/results.md, "The decode attention's split
count for short spans").

Sinks and a window (gpt-oss, layers/sink_attention.py's math): with ``sinks`` split 0 starts its
sums from the sink (m = sinks[h] * log2(e), l = 1: a key of value 0), so every split's partial
and the combine stay as above; with ``window`` W the splits cut [max(n_b - W, 0), n_b) instead
of [0, n_b).

Contract and effects: reads q, the caches and the index tensors; writes a new output of q's
dtype and, with several splits, its own fp32 scratch ([B, H, NUM_SPLITS, D] and
[B, H, NUM_SPLITS]) and, with the combine in the split launch, the device's arrival counters
(`ARRIVALS`: zero before and after each call; calls that share a device run one at a time, as
on one stream); nothing else is written. Launch and buffers depend on shapes only, never on
seq_lens, so a call is CUDA-graph capturable and a replay with other seq_lens re-splits each row
on the device. Requires 1 <= seq_lens[b] and 0 <= row_ids[b] < R (not checked: that would
sync); seq_lens above C are clamped to C.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from arfusion.layers.kernels import pdl
from arfusion.layers.kernels.arrival_counters import ArrivalCounters, last_to_arrive
from arfusion.layers.kernels.triton_slot_rows import sequence_slot_row

BLOCK_N = 64  # keys per inner-loop step
NUM_WARPS = 4
NUM_STAGES = 3  # software-pipelining depth of the key loop
WAVES = 4  # target programs per call: WAVES * SM count
MID_BLOCK_N, MID_WAVES = 128, 2  # mid-size batches: 64 <= B * KVH <= MID_WAVES * SM count
MID_MIN_ROWS = 64
MAX_SPLITS = 64
SHORT_SPAN = 128  # keys a row can hold up to which one program of one block takes the row
NOMINAL_SMS = 132  # H200; used when the tensors are not on a CUDA device (interpreter runs)
# Query heads a kv head serves from which several splits combine in the split launch by default
# (`combine_in_split_for`); fewer keep the combine launch (docs/results.md, "Decode attention in
# one launch": faster at qwen3-30b-a3b's group of 8, slower at llama3-8b's 4)
COMBINE_IN_SPLIT_MIN_GROUP = 8
SPLITS_AT_ONCE = 4  # partials the combine in the split launch loads at once (`combine_group`)
ARRIVALS = ArrivalCounters("decode attention")  # one counter per (sequence, kv head) of a call
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def chunk_bounds(SeqLens, b, split, context, window, NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                 HAS_WINDOW: tl.constexpr, FIXED_CHUNK: tl.constexpr):
    """``(seq_len, start, end, ran)``: row b's key count, the keys ``[start, end)`` of its split
    ``split`` (module docstring; the split is empty when ``start >= seq_len``) and how many of
    the row's splits are not empty."""
    seq_len = tl.minimum(tl.load(SeqLens + b).to(tl.int32), context)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    if FIXED_CHUNK > 0:
        chunk = FIXED_CHUNK
    else:
        chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK) * BLOCK, BLOCK)
    start = lo + split * chunk
    return seq_len, start, tl.minimum(start + chunk, seq_len), tl.cdiv(seq_len - lo, chunk)


@triton.jit
def attend_keys(q, K, V, slot_row, kvh, heads, g_mask, split, Sinks, start, end, qk_scale_log2,
                stride_ks, stride_kh, stride_vs, stride_vh, new_k, new_v, new_key,
                GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                DOT_PRECISION: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_NEW_KEY: tl.constexpr):
    """The online softmax of ``q [GROUP_PAD, HEAD_DIM]`` over keys ``[start, end)`` of one row
    (slots at slot_row) and kv head kvh: ``(m, l, acc)`` in base 2 (module docstring), the sink
    counted in split 0 when HAS_SINKS. With HAS_NEW_KEY, key index ``new_key`` takes its key
    and value from ``new_k, new_v [1, HEAD_DIM]`` (registers) instead of the cache: a program
    that writes that key's slot itself never reads it back."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    if HAS_SINKS:  # split 0 holds the sink: a key of logit sinks[h] and value 0, weight 2^(m - m) = 1
        if split == 0:
            m = tl.load(Sinks + heads, mask=g_mask, other=0.0).to(tl.float32) * 1.4426950408889634
            l = tl.full([GROUP_PAD], 1.0, tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK):
        offs = n0 + offs_n
        valid = offs < end
        slots = tl.load(slot_row + offs, mask=valid, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=valid[:, None], other=0.0)
        if HAS_NEW_KEY:
            k = tl.where((offs == new_key)[:, None], new_k, k)
        x = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [GROUP_PAD, BLOCK]
        x = tl.where(valid[None, :], x, float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(x - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=valid[:, None], other=0.0)
        if HAS_NEW_KEY:
            v = tl.where((offs == new_key)[:, None], new_v, v)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def store_heads(Out, b, heads, g_mask, out, stride_ob, stride_oh, HEAD_DIM: tl.constexpr):
    """``out [GROUP_PAD, HEAD_DIM]`` (fp32) into row b's heads of ``Out``, in Out's dtype."""
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=g_mask[:, None])


@triton.jit
def write_split(PartOut, PartLse, Out, b, heads, g_mask, split, m, l, acc, stride_ob, stride_oh,
                HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """A split's result: with one split the output rows ``acc / l`` themselves, else the
    normalised partial and its log-sum-exp ``m + log2(l)`` for the combine."""
    offs_d = tl.arange(0, HEAD_DIM)
    if NUM_SPLITS == 1:  # the whole row: the output itself (PartOut and PartLse are unused)
        store_heads(Out, b, heads, g_mask, acc / l[:, None], stride_ob, stride_oh, HEAD_DIM)
    else:
        row = (b * NUM_HEADS + heads) * NUM_SPLITS + split  # [B, H, NUM_SPLITS] index
        tl.store(PartOut + row[:, None] * HEAD_DIM + offs_d[None, :], acc / l[:, None], mask=g_mask[:, None])
        tl.store(PartLse + row, m + tl.log2(l), mask=g_mask)


@triton.jit
def combine_group(PartOut, PartLse, Out, b, heads, g_mask, ran, stride_ob, stride_oh, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  SPLITS_PAD: tl.constexpr, SPLITS_AT_ONCE: tl.constexpr = SPLITS_AT_ONCE):
    """Row b's output for the G heads ``heads`` from the partials of its splits 0 .. ran - 1
    (module docstring), read past L1 (other programs stored them): the largest log-sum-exp M
    of each head from one tile, then sum_s w_s o_s and sum_s w_s added in split order. The
    splits come SPLITS_AT_ONCE at a time, unrolled, so that their loads are in flight together
    (one L2 round trip for a row of up to that many splits, not one per split); a split past
    ran_b adds w = 0 and o = 0, which leaves both sums as they were."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_s = tl.arange(0, SPLITS_PAD)
    first = (b * NUM_HEADS + heads) * NUM_SPLITS  # [GROUP_PAD]: split 0 of each head
    lse = tl.load(PartLse + first[:, None] + offs_s[None, :], mask=g_mask[:, None] & (offs_s < ran)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    top = tl.where(g_mask, tl.max(lse, 1), 0.0)  # padded rows: 0, so their (unstored) sums stay finite
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    den = tl.zeros([GROUP_PAD], tl.float32)
    for s0 in range(0, ran, SPLITS_AT_ONCE):
        for i in tl.static_range(SPLITS_AT_ONCE):
            s = s0 + i
            mask = g_mask & (tl.zeros([GROUP_PAD], tl.int32) + s < ran)  # a tensor, also in the interpreter
            w = tl.exp2(tl.load(PartLse + first + s, mask=mask, other=float("-inf"), cache_modifier=".cg") - top)
            o = tl.load(PartOut + (first + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask[:, None], other=0.0,
                        cache_modifier=".cg")
            acc += w[:, None] * o
            den += w
    store_heads(Out, b, heads, g_mask, acc / den[:, None], stride_ob, stride_oh, HEAD_DIM)


@triton.jit
def finish_split(PartOut, PartLse, Out, Arrivals, b, kvh, heads, g_mask, split, ran, m, l, acc, stride_ob, stride_oh,
                 GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
                 NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, COMBINE_IN_SPLIT: tl.constexpr):
    """A split's result (`write_split`). With COMBINE_IN_SPLIT (several splits; module docstring)
    the row's output comes from this launch: a row that its one split covers (``ran == 1``)
    writes acc / l at once; otherwise the last of its ``ran`` splits to arrive at counter (b, kv
    head) of ``Arrivals`` combines them (`combine_group`)."""
    if COMBINE_IN_SPLIT:
        if ran == 1:
            store_heads(Out, b, heads, g_mask, acc / l[:, None], stride_ob, stride_oh, HEAD_DIM)
        else:
            write_split(PartOut, PartLse, Out, b, heads, g_mask, split, m, l, acc, stride_ob, stride_oh, HEAD_DIM,
                        NUM_HEADS, NUM_SPLITS)
            if last_to_arrive(Arrivals, b * tl.num_programs(1) + kvh, ran):
                combine_group(PartOut, PartLse, Out, b, heads, g_mask, ran, stride_ob, stride_oh, GROUP_PAD,
                              HEAD_DIM, NUM_HEADS, NUM_SPLITS, SPLITS_PAD)
    else:
        write_split(PartOut, PartLse, Out, b, heads, g_mask, split, m, l, acc, stride_ob, stride_oh, HEAD_DIM,
                    NUM_HEADS, NUM_SPLITS)


@triton.jit
def _split_kernel(Q, K, V, ReqToToken, RowIds, SeqLens, PartOut, PartLse, Out, Arrivals, Sinks, qk_scale_log2,
                  stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_rb, stride_ob, stride_oh,
                  context, window,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  HAS_ROW_IDS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  FIXED_CHUNK: tl.constexpr, SPLITS_PAD: tl.constexpr, COMBINE_IN_SPLIT: tl.constexpr,
                  USE_PDL: tl.constexpr):
    if USE_PDL:  # everything below reads the step's data (layers/kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, start, end, ran = chunk_bounds(SeqLens, b, split, context, window, NUM_SPLITS, BLOCK, HAS_WINDOW,
                                            FIXED_CHUNK)
    slot_row = sequence_slot_row(ReqToToken, RowIds, b, stride_rb, HAS_ROW_IDS)
    if start < seq_len:
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + offs_g
        g_mask = offs_g < GROUP
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)
        m, l, acc = attend_keys(q, K, V, slot_row, kvh, heads, g_mask, split, Sinks, start, end, qk_scale_log2,
                                stride_ks, stride_kh, stride_vs, stride_vh, 0, 0, 0, GROUP_PAD, HEAD_DIM, BLOCK,
                                DOT_PRECISION, HAS_SINKS, False)
        finish_split(PartOut, PartLse, Out, Arrivals, b, kvh, heads, g_mask, split, ran, m, l, acc, stride_ob,
                     stride_oh, GROUP_PAD, HEAD_DIM, NUM_HEADS, NUM_SPLITS, SPLITS_PAD, COMBINE_IN_SPLIT)


@triton.jit
def _combine_kernel(PartOut, PartLse, SeqLens, Out, stride_ob, stride_oh, context, window,
                    HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    SPLITS_PAD: tl.constexpr, BLOCK: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    FIXED_CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # everything below reads the split kernel's results (layers/kernels/pdl.py)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    _, _, _, ran = chunk_bounds(SeqLens, b, 0, context, window, NUM_SPLITS, BLOCK, HAS_WINDOW, FIXED_CHUNK)
    first = (b * NUM_HEADS + h) * NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM)
    if FIXED_CHUNK > 0:  # splits 0, 1, ..., ran - 1 added in that order: the grid's size changes no bit
        top = tl.load(PartLse + first)
        for s in range(1, ran):
            top = tl.maximum(top, tl.load(PartLse + first + s))
        acc = tl.zeros([HEAD_DIM], tl.float32)
        den = tl.zeros([HEAD_DIM], tl.float32)
        for s in range(0, ran):
            w = tl.exp2(tl.load(PartLse + first + s) - top)
            acc += w * tl.load(PartOut + (first + s) * HEAD_DIM + offs_d)
            den += w
        out = acc / den
    else:
        offs_s = tl.arange(0, SPLITS_PAD)
        s_mask = offs_s < ran
        row = first + offs_s
        lse = tl.load(PartLse + row, mask=s_mask, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))  # 0 for splits that did not run
        o = tl.load(PartOut + row[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return NOMINAL_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_launch(batch: int, num_kv_heads: int, context: int, num_sms: int) -> tuple[int, int]:
    """``(splits per row, keys per block)`` from shapes only: floor(waves * num_sms / (batch *
    kv heads)) programs per (sequence, kv head), at most one per block of the width ``context``,
    between 1 and MAX_SPLITS; waves and block are (MID_WAVES, MID_BLOCK_N) for mid-size batches
    (MID_MIN_ROWS <= batch * kv heads <= MID_WAVES * num_sms), else (WAVES, BLOCK_N); one split of
    one block (the context rounded up to a power of two >= 16) where the context is at most
    SHORT_SPAN keys."""
    if context <= SHORT_SPAN:
        return 1, max(16, triton.next_power_of_2(context))
    rows = batch * num_kv_heads
    waves, block = (MID_WAVES, MID_BLOCK_N) if MID_MIN_ROWS <= rows <= MID_WAVES * num_sms else (WAVES, BLOCK_N)
    return max(1, min(waves * num_sms // rows, -(-context // block), MAX_SPLITS)), block


def check_operands(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                   seq_lens: torch.Tensor, row_ids: Optional[torch.Tensor]) -> None:
    """Shape, dtype, device and layout checks (host metadata only: no sync)."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"need q [B, H, D] and k/v caches [S, KVH, D] of one shape, got q {tuple(q.shape)}, "
                         f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: need the same head_dim "
                         f"and num_heads a multiple of num_kv_heads")
    if dim < 16 or dim & (dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 (tl.arange and tl.dot), got {dim}")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one dtype of {_DTYPES}, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if row_ids is None:
        if req_to_token.dim() != 2 or req_to_token.shape[0] != batch or seq_lens.shape != (batch,):
            raise ValueError(f"need req_to_token [B, C] and seq_lens [B] with B={batch}, got "
                             f"{tuple(req_to_token.shape)} and {tuple(seq_lens.shape)}")
    elif req_to_token.dim() != 2 or row_ids.shape != (batch,) or seq_lens.shape != (batch,):
        raise ValueError(f"need req_to_token [R, C], row_ids [B] and seq_lens [B] with B={batch}, got "
                         f"{tuple(req_to_token.shape)}, {tuple(row_ids.shape)} and {tuple(seq_lens.shape)}")
    indices = {"req_to_token": req_to_token, "seq_lens": seq_lens} | ({} if row_ids is None else {"row_ids": row_ids})
    for name, t in indices.items():
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if len({t.device for t in (q, k_cache, v_cache, *indices.values())}) != 1:
        raise ValueError("all tensors must be on one device")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("the last dimension of q, k_cache, v_cache and req_to_token must be contiguous")
    if not seq_lens.is_contiguous() or (row_ids is not None and not row_ids.is_contiguous()):
        raise ValueError("seq_lens and row_ids must be contiguous")


def check_sinks(sinks: Optional[torch.Tensor], heads: int, device: torch.device, window: int) -> None:
    """``sinks``: None or fp32 ``[heads]`` on ``device``, contiguous; ``window`` >= 0."""
    if sinks is not None and (sinks.shape != (heads,) or sinks.dtype != torch.float32 or sinks.device != device
                              or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous fp32 [{heads}] tensor on {device}, got {sinks.dtype} "
                         f"{tuple(sinks.shape)} on {sinks.device}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no window), got {window}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: Optional[int] = None,
                     row_ids: Optional[torch.Tensor] = None, block: Optional[int] = None,
                     keys_per_split: Optional[int] = None, sinks: Optional[torch.Tensor] = None,
                     window: int = 0, combine_in_split: Optional[bool] = None) -> torch.Tensor:
    """``out [B, H, D] = softmax(scale * q . K^T) @ V`` per (sequence, query head) over the first
    ``seq_lens[b]`` slots of row ``row_ids[b]`` of ``req_to_token [R, C]`` (``row_ids [B]``
    int32/int64; without it row b of ``req_to_token [B, C]``; see the module docstring). Reads
    only; returns a new tensor of q's dtype. ``num_splits`` and ``block`` (keys per block, a
    power of two >= 16; BLOCK_N when only ``num_splits`` is given) override the shape-based
    choice (tests, tuning). ``keys_per_split`` (a multiple of the block; batch-invariant mode)
    fixes each split's keys instead: row b takes ceil(its keys / keys_per_split) splits (its own
    length's, whatever the batch or the width C), the grid ceil(C / keys_per_split), and the
    combine adds the splits one by one in order. ``sinks [H]`` (fp32 logits) join every head's
    softmax denominator as a key of value 0 (split 0 starts its sums with it); ``window`` W > 0
    keeps the last W keys only (the splits cut ``[max(n_b - W, 0), n_b)``):
    layers/sink_attention.py's math. ``combine_in_split``: with several splits, combine them in
    the split launch (True) or in a launch of its own (False); None: as the group size chooses
    (`combine_in_split_for`; module docstring). Requires 1 <=
    seq_lens[b] and 0 <= row_ids[b] < R (not checked: that would sync); values of seq_lens above
    C are clamped to C."""
    check_operands(q, k_cache, v_cache, req_to_token, seq_lens, row_ids)
    check_sinks(sinks, q.shape[1], q.device, window)
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    plan = plan_splits(q, kv_heads, req_to_token.shape[1], num_splits, block, keys_per_split, window,
                       combine_in_split)
    use_pdl = pdl.enabled()
    _split_kernel[(batch, kv_heads, plan.splits)](
        q, k_cache, v_cache, req_to_token, seq_lens if row_ids is None else row_ids, seq_lens, plan.part_out,
        plan.part_lse, plan.out, plan.counters(), seq_lens if sinks is None else sinks, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), plan.out.stride(0), plan.out.stride(1), req_to_token.shape[1], window,
        GROUP=heads // kv_heads, GROUP_PAD=group_pad(heads // kv_heads), HEAD_DIM=dim, NUM_HEADS=heads,
        NUM_SPLITS=plan.splits, BLOCK=plan.block, DOT_PRECISION=dot_precision(q.dtype),
        HAS_ROW_IDS=row_ids is not None, HAS_SINKS=sinks is not None, HAS_WINDOW=window > 0,
        FIXED_CHUNK=keys_per_split or 0, SPLITS_PAD=triton.next_power_of_2(plan.splits),
        COMBINE_IN_SPLIT=plan.arrivals is not None, USE_PDL=use_pdl, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        launch_pdl=use_pdl,
    )
    return combine(plan, seq_lens, req_to_token.shape[1], window, keys_per_split)


class SplitPlan(NamedTuple):
    """A decode call's launch: ``splits`` per row of ``block`` keys, the output ``out [B, H, D]``
    and, with several splits, the fp32 partials ``part_out [B, H, splits, D]`` and ``part_lse
    [B, H, splits]`` (both ``out`` itself, unused, with one split), and ``arrivals``, the
    per-(sequence, kv head) counters of a combine in the split launch (None: the combine is a
    launch of its own, or there is none)."""

    splits: int
    block: int
    out: torch.Tensor
    part_out: torch.Tensor
    part_lse: torch.Tensor
    arrivals: Optional[torch.Tensor] = None

    def counters(self) -> torch.Tensor:
        """The kernel's ``Arrivals`` operand: the counters, or ``out`` standing in, unused."""
        return self.out if self.arrivals is None else self.arrivals


def plan_splits(q: torch.Tensor, kv_heads: int, context: int, num_splits: Optional[int], block: Optional[int],
                keys_per_split: Optional[int], window: int = 0, combine_in_split: Optional[bool] = None) -> SplitPlan:
    """The split count and block (`decode_attention`'s overrides, or `choose_launch` over the keys
    a row can hold: the width ``context``, or the ``window`` where it is narrower) and the buffers
    of a call with ``q [B, H, D]`` (the arrival counters too with several splits combined in the
    split launch: ``combine_in_split``, None for `combine_in_split_for`); ValueError for a block or
    keys_per_split that does not fit."""
    batch, heads, dim = q.shape
    if keys_per_split is not None:
        splits, block = -(-context // keys_per_split), block or BLOCK_N
    elif num_splits is None:
        span = min(context, window) if window > 0 else context
        splits, chosen_block = choose_launch(batch, kv_heads, span, _sm_count(q.device))
        block = block or chosen_block
    else:
        splits, block = num_splits, block or BLOCK_N
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16 (tl.dot), got {block}")
    if keys_per_split is not None and (keys_per_split < block or keys_per_split % block):
        raise ValueError(f"keys_per_split must be a positive multiple of the block ({block}), got {keys_per_split}")
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    if splits == 1:  # the split kernel writes out directly: no partials, no merge (out stands in, unused)
        return SplitPlan(splits, block, out, out, out)
    if combine_in_split is None:
        combine_in_split = combine_in_split_for(heads // kv_heads)
    arrivals = ARRIVALS.get(q.device, batch * kv_heads) if combine_in_split else None
    return SplitPlan(splits, block, out, torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device),
                     torch.empty(batch, heads, splits, dtype=torch.float32, device=q.device), arrivals)


def combine_in_split_for(group: int) -> bool:
    """Whether several splits combine in the split launch by default: a kv head serving at least
    COMBINE_IN_SPLIT_MIN_GROUP query heads (``group``)."""
    return group >= COMBINE_IN_SPLIT_MIN_GROUP


def group_pad(group: int) -> int:
    """Query rows a program holds: the group padded to a power of two >= 16 (tl.dot's M)."""
    return max(16, triton.next_power_of_2(group))


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def combine(plan: SplitPlan, seq_lens: torch.Tensor, context: int, window: int,
            keys_per_split: Optional[int] = None) -> torch.Tensor:
    """The combine launch over ``plan``'s partials when it has several splits and the split
    launch does not combine them itself; returns ``plan.out``."""
    if plan.splits > 1 and plan.arrivals is None:
        out = plan.out
        batch, heads, dim = out.shape
        use_pdl = pdl.enabled()
        _combine_kernel[(batch, heads)](
            plan.part_out, plan.part_lse, seq_lens, out, out.stride(0), out.stride(1), context, window,
            HEAD_DIM=dim, NUM_HEADS=heads, NUM_SPLITS=plan.splits, SPLITS_PAD=triton.next_power_of_2(plan.splits),
            BLOCK=plan.block, HAS_WINDOW=window > 0, FIXED_CHUNK=keys_per_split or 0, USE_PDL=use_pdl, num_warps=4,
            launch_pdl=use_pdl,
        )
    return plan.out


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               req_to_token: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                               row_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same function in plain torch, fp32: gather every sequence's C slots (its row of
    req_to_token, through row_ids when given), mask past seq_lens, softmax, weighted sum. Returns
    fp32 ``[B, H, D]``."""
    if row_ids is not None:
        req_to_token = req_to_token[row_ids.long()]
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    context = req_to_token.shape[1]
    slots = req_to_token.long()
    valid = torch.arange(context, device=q.device)[None, :] < seq_lens[:, None]  # [B, C]
    slots = torch.where(valid, slots, torch.zeros_like(slots))  # ignore whatever pads a row
    keys = k_cache[slots].float().repeat_interleave(heads // kv_heads, dim=2)  # [B, C, H, D]
    values = v_cache[slots].float().repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bhd,bchd->bhc", q.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhc,bchd->bhd", torch.softmax(scores, dim=-1), values)


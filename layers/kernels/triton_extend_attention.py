"""Extend (prefill) attention over the token-slot KV cache in Triton, flash-attention style.

B sequences; sequence i has n_i = seq_lens[i] tokens, of which the last e_i = extend_lens[i]
are new, so its cached prefix is c_i = n_i - e_i tokens long. The T = sum_i e_i new queries are
packed sequence after sequence: sequence i's start in q is s_i = cumsum(extend_lens)[i] - e_i
(computed on the device). Its keys and values are K_i, V_i = k_cache / v_cache[req_to_token[r_i,
:n_i]] (r_i = row_ids[i] when row ids are given, else i), and the new tokens' K/V must already be
in the cache. New token j of sequence i sits at position p = c_i + j and, for query head h
(kv head kh = h // G, G = H / KVH):

    out[s_i + j, h] = softmax(scale * q[s_i + j, h] . K_i[:p+1, kh]^T) @ V_i[:p+1, kh]

(causal, the cached prefix fully visible; fp32 accumulation, the output in q's dtype).

GQA packing. A program owns BLOCK_T consecutive new tokens of one sequence and HEADS query heads
that share one kv head: its BLOCK_M = BLOCK_T * HEADS query rows are (token, head) pairs, row r
being token t0 + r // HEADS and head kh * G + chunk * HEADS + r % HEADS. So every K/V block is
read once for all the heads of a kv head (HEADS = next_pow2(G), at most BLOCK_M; a group wider
than BLOCK_M is cut into cdiv(G, HEADS) chunks; rows of heads past G are padding, computed and
not stored), and q.K^T and p.V are ``tl.dot`` products of [BLOCK_M, D] x [D, BLOCK_N] and
[BLOCK_M, BLOCK_N] x [BLOCK_N, D] (tensor cores: BLOCK_M, BLOCK_N >= 16).

Grid: (cdiv(max_extend_len, BLOCK_T), KVH * chunks, B). Axis 0 is the token block, numbered
from the end (the first programs launched get the last blocks, which see the most keys: a
shorter tail), and fastest, so that the programs in flight together read the same sequence's
K/V (L2 reuse). A program whose block starts at or past e_i exits at once.

Key loop of the program with tokens [t0, t0 + BLOCK_T) of sequence i: query rows sit at
positions c_i + t0 ... c_i + t0 + BLOCK_T - 1, so

    keys [0, F)             F = floor((c_i + t0) / BLOCK_N) * BLOCK_N: visible to every row, no mask
    keys [F, E)             E = min(n_i, c_i + t0 + BLOCK_T): key pos <= row pos masked in
    keys [E, n_i)           past the causal limit of every row: never loaded

Each row's first masked block holds its own position, so no row ever has only -inf scores.
``mask_all`` (batch-invariant mode) takes every block through the masked step (F = 0): then a
row's blocks run one instruction sequence whatever its token block's start t0 (which depends on
how the prompt was chunked), where otherwise the compiler may contract the unmasked step's
scale-and-subtract into one fused multiply-add that the masked step rounds in two; blocks past a
row's position leave its running sums exactly as they were (p = 0, alpha = 1).
Online softmax in base 2 (x = scale * log2(e) * q.k, exp2 for exp): running max m, running sum
l = sum_j 2^(x_j - m), acc = sum_j 2^(x_j - m) v_j, rescaled by 2^(m_old - m_new) when the max
grows; out = acc / l.

Sinks and a window (gpt-oss, layers/sink_attention.py's math): with ``sinks`` a row's sums start
from its head's sink (m = sinks[h] * log2(e), l = 1: a key of value 0 every row sees); with
``window`` W a row also masks keys at or before p - W, F = 0 (every block masked), and the key
loop starts at the block of the first row's first visible key, floor(max(c_i + t0 - W + 1, 0) /
BLOCK_N) * BLOCK_N (still aligned at key 0). A row's first block may then hold none of its keys:
without a sink its exponents are taken from 0 while its max is -inf, so its sums stay zero.

Host sync: only to size the grid. Pass ``max_extend_len`` (a host int >= max(extend_lens), e.g.
from the scheduler) and the call has none (it is then CUDA-graph capturable); without it one
device-to-host copy reads max(extend_lens) and checks the lengths (0 <= e_i <= n_i <= width of
req_to_token, sum e_i = T).

Block sizes (`choose_block_config`): (BLOCK_M, BLOCK_N, warps, stages) = (128, 64, 8, 3) for
fp16/bf16 with D <= 128 (the usual flash-attention forward tiling for D = 128 on sm90), smaller
tiles for wider heads and fp32, so that the registers do not spill.

Effects: reads q, the caches and the index tensors; writes only a new ``[T, H, D]`` output of
q's dtype.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from arfusion.layers.kernels.triton_decode_attention import check_sinks
from arfusion.layers.kernels.triton_slot_rows import sequence_slot_row

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


class BlockConfig(NamedTuple):
    block_m: int  # query rows (token, head) per program
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int  # software-pipelining depth of the key loop


@triton.jit
def _attend_block(acc, l, m, q, K, V, slot_row, n0, end, q_pos, kvh, qk_scale_log2,
                  stride_ks, stride_kh, stride_vs, stride_vh, window,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """One online-softmax step over keys [n0, n0 + BLOCK_N): returns the updated (acc, l, m).
    CAUSAL: keys at or past ``end`` are not loaded and a row sees only keys at or before its
    position ``q_pos`` (and, HAS_WINDOW, after ``q_pos - window``: a block may then hold no key
    of a row, whose sums it leaves as they were); else every key of the block is valid and visible."""
    offs = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if CAUSAL:
        valid = offs < end
        slots = tl.load(slot_row + offs, mask=valid, other=0).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :], mask=valid[:, None], other=0.0)
    else:
        slots = tl.load(slot_row + offs).to(tl.int64)
        k = tl.load(K + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :])
        v = tl.load(V + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :])
    x = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale_log2  # [BLOCK_M, BLOCK_N]
    if CAUSAL:
        visible = valid[None, :] & (offs[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs[None, :] > q_pos[:, None] - window)
        x = tl.where(visible, x, float("-inf"))
    m_new = tl.maximum(m, tl.max(x, 1))
    if HAS_WINDOW:  # a row that has seen no key yet keeps m = -inf: exponents from 0, not -inf - -inf
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_base)
        p = tl.exp2(x - m_base[:, None])
    else:
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(x - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l, m_new


@triton.jit
def _extend_kernel(Q, K, V, Out, ReqToToken, RowIds, SeqLens, ExtendLens, ExtendStarts, Sinks, qk_scale_log2,
                   stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
                   stride_rb, window,
                   GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_CHUNKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, HAS_ROW_IDS: tl.constexpr, UNMASKED_STEP: tl.constexpr,
                   HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    t0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_T  # the last blocks first
    kvh = tl.program_id(1) // HEAD_CHUNKS
    chunk = tl.program_id(1) % HEAD_CHUNKS
    b = tl.program_id(2)
    extend_len = tl.load(ExtendLens + b).to(tl.int32)
    if t0 < extend_len:
        seq_len = tl.load(SeqLens + b).to(tl.int32)
        prefix = seq_len - extend_len
        q_start = tl.load(ExtendStarts + b).to(tl.int64)
        slot_row = sequence_slot_row(ReqToToken, RowIds, b, stride_rb, HAS_ROW_IDS)
        offs_r = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        token = t0 + offs_r // HEADS  # index among the sequence's new tokens
        in_group = chunk * HEADS + offs_r % HEADS
        head = kvh * GROUP + in_group
        row_mask = (token < extend_len) & (in_group < GROUP)
        q_rows = (q_start + token) * stride_qt + head * stride_qh
        q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None], other=0.0)
        q_pos = prefix + token
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        if HAS_SINKS:  # the sink: a key of logit sinks[h] and value 0, weight 2^(m - m) = 1
            m = tl.load(Sinks + head, mask=in_group < GROUP, other=0.0).to(tl.float32) * 1.4426950408889634
            l = tl.full([BLOCK_M], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        full_end = (prefix + t0) // BLOCK_N * BLOCK_N * UNMASKED_STEP  # 0: every block masked
        for n0 in range(0, full_end, BLOCK_N):
            acc, l, m = _attend_block(acc, l, m, q, K, V, slot_row, n0, full_end, q_pos, kvh, qk_scale_log2,
                                      stride_ks, stride_kh, stride_vs, stride_vh, window,
                                      HEAD_DIM, BLOCK_N, False, DOT_PRECISION, False)
        masked_start = full_end
        if HAS_WINDOW:  # from the block of the first row's first visible key (blocks stay aligned at key 0)
            masked_start = tl.maximum(prefix + t0 - window + 1, 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(seq_len, prefix + t0 + BLOCK_T)
        for n0 in range(masked_start, end, BLOCK_N):
            acc, l, m = _attend_block(acc, l, m, q, K, V, slot_row, n0, end, q_pos, kvh, qk_scale_log2,
                                      stride_ks, stride_kh, stride_vs, stride_vh, window,
                                      HEAD_DIM, BLOCK_N, True, DOT_PRECISION, HAS_WINDOW)
        out_rows = (q_start + token) * stride_ot + head * stride_oh
        tl.store(Out + out_rows[:, None] + offs_d[None, :], (acc / l[:, None]).to(Out.dtype.element_ty),
                 mask=row_mask[:, None])


def choose_block_config(dtype: torch.dtype, head_dim: int) -> BlockConfig:
    """Tiles from the element size and head_dim: (128, 64, 8 warps, 3 stages) for 2-byte types
    with head_dim <= 128; (32, 32, 4, 2) for wider 2-byte heads; (16, 16, 4, 2) for fp32 (no
    tensor cores; the layer runs fp32 in torch), so that the sm90 build does not spill registers."""
    if dtype.itemsize == 2:
        if head_dim <= 128:
            return BlockConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
        return BlockConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)
    return BlockConfig(block_m=16, block_n=16, num_warps=4, num_stages=2)


def _is_pow2_at_least_16(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
           seq_lens: torch.Tensor, extend_lens: torch.Tensor, row_ids: Optional[torch.Tensor]) -> None:
    """Shape, dtype, device and layout checks (host metadata only: no sync)."""
    if q.dim() not in (2, 3) or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        raise ValueError(f"need q [T, H*D] or [T, H, D] and k/v caches [S, KVH, D] of one shape, got "
                         f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    kv_heads, dim = k_cache.shape[1:]
    q_dim_ok = q.shape[1] % dim == 0 if q.dim() == 2 else q.shape[2] == dim
    heads = q.shape[1] // dim if q.dim() == 2 else q.shape[1]
    if not q_dim_ok or heads == 0 or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: need the same head_dim "
                         f"and num_heads a multiple of num_kv_heads")
    if not _is_pow2_at_least_16(dim):
        raise ValueError(f"head_dim must be a power of two >= 16 (tl.arange and tl.dot), got {dim}")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one dtype of {_DTYPES}, got "
                         f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if batch < 1 or extend_lens.shape != (batch,) or req_to_token.dim() != 2:
        raise ValueError(f"need seq_lens [B] and extend_lens [B] (B >= 1) and a 2-D req_to_token, got "
                         f"{tuple(seq_lens.shape)}, {tuple(extend_lens.shape)} and {tuple(req_to_token.shape)}")
    if row_ids is None and req_to_token.shape[0] != batch:
        raise ValueError(f"need req_to_token [B, C] with B={batch}, got {tuple(req_to_token.shape)}")
    if row_ids is not None and row_ids.shape != (batch,):
        raise ValueError(f"need row_ids [B] with B={batch}, got {tuple(row_ids.shape)}")
    indices = {"req_to_token": req_to_token, "seq_lens": seq_lens, "extend_lens": extend_lens}
    if row_ids is not None:
        indices["row_ids"] = row_ids
    for name, t in indices.items():
        if t.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if len({t.device for t in (q, k_cache, v_cache, *indices.values())}) != 1:
        raise ValueError("all tensors must be on one device")
    if q.stride(-1) != 1 or k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("the last dimension of q, k_cache, v_cache and req_to_token must be contiguous")
    if not all(t.is_contiguous() for name, t in indices.items() if name != "req_to_token"):
        raise ValueError("seq_lens, extend_lens and row_ids must be contiguous")


def _read_max_extend_len(seq_lens: torch.Tensor, extend_lens: torch.Tensor, tokens: int, context: int) -> int:
    """max(extend_lens), in one device-to-host copy that also checks 0 <= extend_lens <= seq_lens
    <= context and sum(extend_lens) == tokens."""
    seq_lens, extend_lens = seq_lens.long(), extend_lens.long()
    stats = torch.stack([extend_lens.max(), extend_lens.min(), extend_lens.sum(), (seq_lens - extend_lens).min(),
                         seq_lens.max()]).tolist()
    longest, shortest, total, min_prefix, max_seq_len = stats
    if shortest < 0 or min_prefix < 0:
        raise ValueError(f"need 0 <= extend_lens <= seq_lens, got extend_lens {extend_lens.tolist()} and "
                         f"seq_lens {seq_lens.tolist()}")
    if max_seq_len > context:
        raise ValueError(f"seq_lens up to {max_seq_len} exceed the width {context} of req_to_token")
    if total != tokens:
        raise ValueError(f"q has {tokens} tokens but sum(extend_lens) = {total}")
    return longest


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, req_to_token: torch.Tensor,
                     seq_lens: torch.Tensor, extend_lens: torch.Tensor, scale: float,
                     row_ids: Optional[torch.Tensor] = None, max_extend_len: Optional[int] = None,
                     block_m: Optional[int] = None, block_n: Optional[int] = None,
                     mask_all: bool = False, sinks: Optional[torch.Tensor] = None, window: int = 0) -> torch.Tensor:
    """``out [T, H, D]``: causal attention of the T packed new tokens (``q [T, H*D]`` or
    ``[T, H, D]``, last dim contiguous, any token/head strides) over ``k_cache``/``v_cache``
    ``[num_slots, KVH, D]`` through ``req_to_token [B, C]`` (or ``[R, C]`` read at ``row_ids [B]``),
    ``seq_lens [B]`` and ``extend_lens [B]``; see the module docstring for the math and the grid.

    Reads only; returns a new tensor of q's dtype. ``max_extend_len``: a host int >=
    max(extend_lens) that sizes the grid without a host sync (its lengths are then not checked);
    None reads it from the device, once. ``block_m``/``block_n`` (powers of two >= 16) override
    `choose_block_config` (tests, tuning). ``mask_all``: every key block through the masked step
    (batch-invariant mode; the module docstring). ``sinks [H]`` (fp32 logits: a key of value 0 in
    every row's softmax, its sums start with it) and ``window`` W > 0 (a row sees the W keys up
    to its own; every block goes through the masked step, from the block of the program's first
    visible key): layers/sink_attention.py's math. Requires 0 <= row_ids[i] < R and slots <
    num_slots (not checked: that would read the tables)."""
    _check(q, k_cache, v_cache, req_to_token, seq_lens, extend_lens, row_ids)
    check_sinks(sinks, q.shape[1] if q.dim() == 3 else q.shape[1] // k_cache.shape[2], q.device, window)
    tokens = q.shape[0]
    kv_heads, dim = k_cache.shape[1:]
    q = q.unflatten(1, (-1, dim)) if q.dim() == 2 else q
    heads = q.shape[1]
    if max_extend_len is None:
        max_extend_len = _read_max_extend_len(seq_lens, extend_lens, tokens, req_to_token.shape[1])
    elif not 0 <= max_extend_len <= tokens:
        raise ValueError(f"max_extend_len must be in [0, T={tokens}], got {max_extend_len}")
    config = choose_block_config(q.dtype, dim)
    config = config._replace(block_m=block_m or config.block_m, block_n=block_n or config.block_n)
    if not (_is_pow2_at_least_16(config.block_m) and _is_pow2_at_least_16(config.block_n)):
        raise ValueError(f"block_m and block_n must be powers of two >= 16, got {config.block_m}, {config.block_n}")
    group = heads // kv_heads
    heads_per_program = min(triton.next_power_of_2(group), config.block_m)
    head_chunks = -(-group // heads_per_program)
    block_t = config.block_m // heads_per_program
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if max_extend_len == 0:
        return out
    extend_starts = torch.cumsum(extend_lens, 0) - extend_lens
    grid = (triton.cdiv(max_extend_len, block_t), kv_heads * head_chunks, seq_lens.shape[0])
    _extend_kernel[grid](
        q, k_cache, v_cache, out, req_to_token, extend_lens if row_ids is None else row_ids, seq_lens, extend_lens,
        extend_starts, extend_starts if sinks is None else sinks, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), req_to_token.stride(0), window,
        GROUP=group, HEADS=heads_per_program, HEAD_CHUNKS=head_chunks, HEAD_DIM=dim,
        BLOCK_M=config.block_m, BLOCK_T=block_t, BLOCK_N=config.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", HAS_ROW_IDS=row_ids is not None,
        UNMASKED_STEP=0 if mask_all or window > 0 else 1, HAS_SINKS=sinks is not None, HAS_WINDOW=window > 0,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def extend_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               req_to_token: torch.Tensor, seq_lens: torch.Tensor, extend_lens: torch.Tensor,
                               scale: float, row_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The same function in plain torch, fp32, one sequence at a time: gather its n_i keys and
    values (its row of req_to_token, through row_ids when given), mask key positions past each
    query's position (bottom-right-aligned causal mask), softmax, weighted sum. Returns fp32
    ``[T, H, D]``."""
    kv_heads, dim = k_cache.shape[1:]
    q = q.unflatten(1, (-1, dim)) if q.dim() == 2 else q
    group = q.shape[1] // kv_heads
    rows = req_to_token if row_ids is None else req_to_token[row_ids.long()]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for i, (seq_len, new) in enumerate(zip(seq_lens.tolist(), extend_lens.tolist())):
        slots = rows[i, :seq_len].long()
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [n, H, D]
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,nhd->htn", q[start:start + new].float(), keys) * scale
        query_pos = torch.arange(seq_len - new, seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [new, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:start + new] = torch.einsum("htn,nhd->thd", torch.softmax(scores, dim=-1), values)
        start += new
    return out


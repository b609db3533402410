"""Attention whose every row is a function of that row alone (the torch path of batch-invariant
mode, `layers.batch_invariant`).

For query i at position p_i (``q [t, H, D]``) over its sequence's keys and values (``[n, KVH,
D]``, query head h reading KV head h // (H / KVH)), with the keys cut into blocks of `KEY_BLOCK`
aligned at key 0 (block b holds keys [b * KEY_BLOCK, (b + 1) * KEY_BLOCK), zero past the
sequence):

    s_ij   = (q_i . k_j) * scale                       for j <= p_i, else masked
    m_i    = max_j s_ij                                 (exact in any order)
    w_ij   = exp(s_ij - m_i), 0 where masked
    [o_ib | l_ib] = w_i,block_b @ [V_b | 1]             one GEMM per block: numerator and sum
    out_i  = tree_b(o_ib) / tree_b(l_ib)

in fp32. The dot products and the per-block sums are GEMMs of fixed shapes on the CPU: a tile
of M query rows (a query's H / KVH heads of one KV head are consecutive rows; M zero-padded to
a multiple of `ROW_TILE`) times one block of keys, ``[M, D] @ [D, KEY_BLOCK]`` and ``[M,
KEY_BLOCK] @ [KEY_BLOCK, D + 1]``, so every call runs over the same reduction length, and for
these short reductions (D and KEY_BLOCK) the CPU GEMMs give a row the same bits at any M that is
a multiple of `ROW_TILE` and in any position of the tile (checked by
tests/test_batch_invariant_ops.py; `layers.batch_invariant.linear`, whose reductions are a
model's hidden sizes, calls its GEMMs with exactly `ROW_TILE` rows instead). tree_b is `layers.batch_invariant.tree_sum` over the blocks
(zero-padded to a power of two); a block past p_i has w = 0, so it adds exact zeros, and a tree
whose leaves past 2^a are zero gives the bits of the tree over the first 2^a. So row i's bits
depend only on q_i, the keys [0, p_i] and their values: not on n, the other queries of the call,
the chunk of the prompt it came in, the other rows of a decode batch, nor on whether it is a
prefill row or a decode row.

Memory: the calls take queries (`attend_sequence`) or decode rows (`attend_decode`) in groups
whose largest intermediate (the scores ``[KVH, blocks, M, KEY_BLOCK]``, or a decode group's
gathered keys) holds at most ``max_scores`` elements, and each group reads only the key blocks
up to its last query's position: a prompt of T tokens costs the causal T^2 / 2 products in
GEMMs, with memory of the bound, not of T^2.

On a CUDA device (off the Triton kernels: fp32, or a head dim that is not a power of two) GEMMs
may pick other kernels by batch count, so `attend_elementwise` forms the dot products and sums
by elementwise products and the fixed tree instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from arfusion.layers.batch_invariant import ROW_TILE, tree_sum
from arfusion.layers.sink_attention import attend_with_sinks

KEY_BLOCK = 256  # keys per GEMM block (a multiple of every CPU vector width)


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _attend_blocks(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """The module's recipe for S independent sequences: ``q [S, t, H, D]`` at positions
    ``q_pos [S, t]`` over ``keys, values [S, n, KVH, D]`` (finite; key j visible to a query iff
    j <= its position). Returns ``[S, t, H, D]`` fp32. Reads only."""
    seqs, t, heads, dim = q.shape
    n, kv_heads = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    rows = t * group
    tile = _padded(rows, ROW_TILE)
    padded = _padded(n, KEY_BLOCK)
    blocks = padded // KEY_BLOCK
    # query rows [S, KVH, M, D]: row r is query r // group, head (kv head) * group + r % group
    qr = q.float().reshape(seqs, t, kv_heads, group, dim).permute(0, 2, 1, 3, 4).reshape(seqs, kv_heads, rows, dim)
    qr = F.pad(qr, (0, 0, 0, tile - rows))
    pos = F.pad(q_pos.repeat_interleave(group, dim=1), (0, tile - rows))  # [S, M]; pad rows see key 0
    k = F.pad(keys.float(), (0, 0, 0, 0, 0, padded - n)) if padded != n else keys.float()
    k = k.view(seqs, blocks, KEY_BLOCK, kv_heads, dim).permute(0, 3, 1, 4, 2)  # [S, KVH, nb, D, KB]
    scores = torch.matmul(qr[:, :, None], k).mul_(scale)  # [S, KVH, nb, M, KB]
    key_pos = torch.arange(padded, device=q.device).view(1, 1, blocks, 1, KEY_BLOCK)
    scores.masked_fill_(key_pos > pos[:, None, None, :, None], float("-inf"))
    weights = scores.sub_(scores.amax(dim=(2, 4), keepdim=True)).exp_()
    v = torch.cat([values.float(), torch.ones(seqs, n, kv_heads, 1, device=q.device)], dim=-1)
    v = F.pad(v, (0, 0, 0, 0, 0, padded - n)) if padded != n else v
    v = v.view(seqs, blocks, KEY_BLOCK, kv_heads, dim + 1).permute(0, 3, 1, 2, 4)  # [S, KVH, nb, KB, D + 1]
    sums = tree_sum(torch.matmul(weights, v).permute(0, 1, 3, 4, 2))  # [S, KVH, M, D + 1]
    out = sums[:, :, :rows, :dim] / sums[:, :, :rows, dim:]
    return out.reshape(seqs, kv_heads, t, group, dim).permute(0, 2, 1, 3, 4).reshape(seqs, t, heads, dim)


def attend_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float,
                    max_scores: int = 1 << 24) -> torch.Tensor:
    """One sequence: ``q [t, H, D]`` at positions ``q_pos [t]`` over ``keys, values [n, KVH,
    D]`` (key j visible to query i iff j <= q_pos[i] < n). Queries in groups whose scores hold
    at most ``max_scores`` elements (at least one query), each over the key blocks up to its
    last position. Returns ``[t, H, D]`` in q's dtype (the module docstring). Reads only."""
    t, heads, _ = q.shape
    kv_heads, group = keys.shape[1], heads // keys.shape[1]
    per_query = kv_heads * _padded(keys.shape[0], KEY_BLOCK)
    queries = max(1, (max_scores // per_query) // ROW_TILE * ROW_TILE // group)
    out = torch.empty_like(q)
    for start in range(0, t, queries):
        end = min(t, start + queries)
        seen = int(q_pos[start:end].max()) + 1
        out[start:end] = _attend_blocks(q[None, start:end], q_pos[None, start:end], keys[None, :seen],
                                        values[None, :seen], scale)[0].to(q.dtype)
    return out


def attend_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_slots: torch.Tensor,
                  seq_lens: torch.Tensor, scale: float, max_scores: int = 1 << 24) -> torch.Tensor:
    """A decode batch: row i's query ``q[i] [H, D]`` at position ``seq_lens[i] - 1`` over the keys
    and values of its slots ``seq_slots[i, :seq_lens[i]]`` in ``k_cache, v_cache [slots, KVH,
    D]``. Rows in groups, each gathering its rows' keys up to the group's longest sequence
    (whole blocks, zero past each row's length) within ``max_scores`` elements for the keys and
    values together (at least one row). Returns ``[B, H, D]`` in q's dtype. Reads only."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    per_key = kv_heads * max(_padded(heads // kv_heads, ROW_TILE), 2 * (dim + 1))  # the scores', or keys and values
    lens = seq_lens.tolist()
    out = torch.empty_like(q)
    start = 0
    while start < len(lens):
        end, longest = start + 1, lens[start]
        while end < len(lens) and (end + 1 - start) * per_key * _padded(max(longest, lens[end]), KEY_BLOCK) <= max_scores:
            longest = max(longest, lens[end])
            end += 1
        width = _padded(longest, KEY_BLOCK)
        slots = F.pad(seq_slots[start:end, :longest], (0, width - longest))
        beyond = (torch.arange(width, device=q.device)[None, :] >= seq_lens[start:end, None])[:, :, None, None]
        keys = k_cache[slots].masked_fill_(beyond, 0)  # [b, width, KVH, D]: zero past each row
        values = v_cache[slots].masked_fill_(beyond, 0)
        out[start:end] = _attend_blocks(q[start:end, None], seq_lens[start:end, None] - 1, keys, values,
                                        scale)[:, 0].to(q.dtype)
        start = end
    return out


def attend_elementwise(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """The recipe without GEMMs, for a CUDA device: ``q [t, H, D]`` at positions ``q_pos [t]``
    over ``keys, values [n, KVH, D]`` shared by the t queries, or ``[t, n, KVH, D]``, one set
    per query (a decode batch padded to n with anything: masked).

        s_ij = tree_D(q_i * k_j) * scale,  w_ij = exp(s_ij - max_j s_ij),
        out_i = tree_j(w_ij * v_j) / tree_j(w_ij)

    with masked keys contributing exact zeros to the trees (so a row's bits depend on its own
    keys only): `layers.sink_attention.attend_with_sinks` with no sinks and no window (the same
    products and trees). Returns ``[t, H, D]`` in q's dtype. Reads only."""
    return attend_with_sinks(q, keys, values, q_pos, scale, None, 0)

"""Attention of one sequence whose every row is a function of that row alone (the CPU path of
batch-invariant mode, `layers.batch_invariant`).

For query i at position p_i (``q [t, H, D]``) over the sequence's n keys and values
(``[n, KVH, D]``, query head h reading KV head h // (H / KVH)):

    s_ij = tree_D(q_i * k_j) * scale                     for j <= p_i, else masked
    m_i  = max_j s_ij                                    (exact in any order)
    w_ij = exp(s_ij - m_i), 0 where masked
    out_i = tree_j(w_ij * v_j) / tree_j(w_ij)

in fp32, where tree_D and tree_j are `layers.batch_invariant.tree_sum`: a pairwise tree over the
dim zero-padded to a power of two. A masked key contributes an exact +0, and a tree over 2^b
leaves whose leaves past 2^a are zero gives the same bits as the tree over the first 2^a; so
row i's bits depend only on q_i, the keys [0, p_i] and their values, not on n, on the other
queries of the call, on the chunk of the prompt it came in, nor on whether it is a prefill row
or a decode row. Queries are taken in groups sized to a memory budget (the group size changes
no bit: every step is elementwise per query or a reduction over its own row).
"""
from __future__ import annotations

import torch

from layers.batch_invariant import tree_sum

WORK_ELEMENTS = 1 << 24  # fp32 elements of the [queries, H, keys, D] products held at once


def attend_sequence(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """``q [t, H, D]`` at positions ``q_pos [t]`` over ``keys, values``: ``[n, KVH, D]`` shared by
    the t queries (one sequence), or ``[t, n, KVH, D]``, one set per query (a decode batch, each
    row its own sequence's keys, padded to n with anything finite or not: masked). Key j is
    visible to query i iff j <= q_pos[i]. Returns ``[t, H, D]`` in q's dtype (the module
    docstring). Reads only."""
    if keys.dim() == 3:
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    heads, kv_heads = q.shape[1], keys.shape[2]
    group = heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # [1 or t, H, n, D]
    v = values.float().repeat_interleave(group, dim=2).permute(0, 2, 3, 1)  # [1 or t, H, D, n]
    n, dim = keys.shape[1], keys.shape[3]
    rows = max(1, WORK_ELEMENTS // (heads * n * dim))
    key_pos = torch.arange(n, device=q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[0], rows):
        qi = q[start:start + rows].float()  # [r, H, D]
        ki, vi = (k, v) if k.shape[0] == 1 else (k[start:start + rows], v[start:start + rows])
        visible = (key_pos[None, :] <= q_pos[start:start + rows, None])[:, None, :]  # [r, 1, n]
        scores = tree_sum(qi[:, :, None, :] * ki) * scale  # [r, H, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        weights = torch.where(visible, weights, torch.zeros_like(weights))
        weighted = torch.where(visible[:, :, None, :], weights[:, :, None, :] * vi, 0.0)  # [r, H, D, n]
        out[start:start + rows] = tree_sum(weighted) / tree_sum(weights)[:, :, None]
    return out.to(q.dtype)

"""Attention with learned sinks and a sliding window (gpt-oss), in torch: the CPU path and the
reference of the Triton kernels' sink and window options.

For query i at position p_i (``q [t, H, D]``) over its sequence's keys and values (``[n, KVH,
D]``, query head h reading KV head h // (H / KVH)), window W (0: none) and sink logit z_h:

    visible(i, j) = j <= p_i  and  (W == 0  or  j > p_i - W)       W keys, the query's own included
    s_ij  = tree_D(q_i * k_j) * scale                              visible keys only
    m_i   = max(max_j s_ij, z_h)
    w_ij  = exp(s_ij - m_i)
    out_i = tree_j(w_ij * v_j) / (tree_j(w_ij) + exp(z_h - m_i))

in fp32: the sink is a key every query sees whose value is zero; it joins the softmax's
denominator only, so a head can attend to "nothing". Without sinks the last term is absent.
tree_D and tree_j are `layers.batch_invariant.tree_sum` (a fixed pairwise tree), so a row's bits
depend on that row's inputs alone, as in `layers.batch_invariant_attention` (this path serves
both modes: its rows are batch-invariant by construction).
"""
from __future__ import annotations

from typing import Optional

import torch

from arfusion.layers.batch_invariant import tree_sum

WORK_ELEMENTS = 1 << 24  # fp32 elements of the [queries, H, keys, D] products held at once


def visible_keys(q_pos: torch.Tensor, n: int, window: int) -> torch.Tensor:
    """``[t, n]`` bool: key j visible to the query at ``q_pos[i]`` (causal, within ``window``)."""
    key_pos = torch.arange(n, device=q_pos.device)[None, :]
    visible = key_pos <= q_pos[:, None]
    if window:
        visible &= key_pos > q_pos[:, None] - window
    return visible


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float,
                      sinks: Optional[torch.Tensor], window: int) -> torch.Tensor:
    """``q [t, H, D]`` at ``q_pos [t]`` over ``keys, values`` ``[n, KVH, D]`` (one sequence) or
    ``[t, n, KVH, D]`` (one set per query, padded with anything: masked); ``sinks [H]`` (fp32
    logits) or None; ``window`` 0 or the sliding window. Returns ``[t, H, D]`` in q's dtype by
    the module docstring's math. Reads only."""
    if keys.dim() == 3:
        keys, values = keys.unsqueeze(0), values.unsqueeze(0)
    heads, kv_heads = q.shape[1], keys.shape[2]
    group = heads // kv_heads
    k = keys.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # [1 or t, H, n, D]
    v = values.float().repeat_interleave(group, dim=2).permute(0, 2, 3, 1)  # [1 or t, H, D, n]
    n, dim = keys.shape[1], keys.shape[3]
    rows = max(1, WORK_ELEMENTS // (heads * n * dim))
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    sink = None if sinks is None else sinks.float()[None, :]  # [1, H]
    for start in range(0, q.shape[0], rows):
        qi = q[start:start + rows].float()  # [r, H, D]
        ki, vi = (k, v) if k.shape[0] == 1 else (k[start:start + rows], v[start:start + rows])
        visible = visible_keys(q_pos[start:start + rows], n, window)[:, None, :]  # [r, 1, n]
        scores = tree_sum(qi[:, :, None, :] * ki) * scale  # [r, H, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        m = scores.amax(dim=-1)  # [r, H]
        if sink is not None:
            m = torch.maximum(m, sink)
        weights = torch.where(visible, torch.exp(scores - m[:, :, None]), torch.zeros_like(scores))
        weighted = torch.where(visible[:, :, None, :], weights[:, :, None, :] * vi, 0.0)  # [r, H, D, n]
        denominator = tree_sum(weights)
        if sink is not None:
            denominator = denominator + torch.exp(sink - m)
        out[start:start + rows] = tree_sum(weighted) / denominator[:, :, None]
    return out.to(q.dtype)

"""The experts of a MoE layer in torch: the reference of the Triton fused MoE, and the CPU path.

For token t and its slots j = 0..k-1 (expert ``e = ids[t, j]``, routing weight ``w[t, j]``),
with this rank's expert shards ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]``:

    gate, up = split(x[t] @ w13[e]^T)            rounded to x's dtype (a matmul's output)
    a        = silu(gate) * up                   silu rounded to the dtype, then the product
    y[t, j]  = a @ w2[e]^T                       rounded to the dtype
    out[t]   = sum_j w[t, j] * y[t, j]           the unfused combine: fp32 products and sum
                                                 (one batched matmul), rounded once

``out`` is this rank's partial sum (its columns of every gate/up, its rows of every down): the
sum over TP ranks is the full MoE output, which the caller reduces (fused with the residual add
and the next RMSNorm, as a dense MLP's down projection).
"""
from __future__ import annotations

import torch

from arfusion.layers import batch_invariant
from arfusion.layers.activation import SiluAndMul


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``y [T, k, H]`` of the module docstring (x's dtype), one matmul pair per expert that has
    tokens. Reads the per-expert token counts back to the host (a reference, not a fast path)."""
    tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten().long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    y = x.new_empty(tokens * top_k, w2.shape[1])
    act = SiluAndMul()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            slots = order[start:start + count]
            gate_up = batch_invariant.linear(x[slots // top_k], w13[expert])
            y[slots] = batch_invariant.linear(act.forward_torch(gate_up), w2[expert])
            start += count
    return y.view(tokens, top_k, -1)


def combine_topk(y: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The unfused combine: ``y [T, k, H]``, ``topk_weights [T, k]`` -> a new ``[T, H]`` of y's
    dtype, ``sum_j w[t, j] * y[t, j]`` in fp32 (a batched ``[1, k] @ [k, H]`` per token, as one
    reduction launch of an engine's MoE sum would do it), rounded once; in batch-invariant mode
    the k fp32 products by `batch_invariant.tree_sum`'s fixed tree."""
    if batch_invariant.enabled():
        return batch_invariant.tree_sum((topk_weights.float()[:, :, None] * y.float()).transpose(1, 2)).to(y.dtype)
    return torch.bmm(topk_weights.float().unsqueeze(1), y.float()).squeeze(1).to(y.dtype)


def moe_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """``x [T, H]`` -> this rank's partial MoE output ``[T, H]`` (module docstring): the expert
    outputs, then the unfused combine. New tensors; nothing is written in place."""
    if x.shape[0] == 0:
        return x.new_empty(0, w2.shape[1])
    return combine_topk(expert_outputs(x, w13, w2, topk_ids), topk_weights)

"""An attention block's middle: the rotary embedding of the new tokens' q and k (with Qwen3's
per-head q/k norm when given), their keys and values written to the KV cache, and the attention
over the cache; with ``--rotary-into-attention`` a decode batch's all in one launch.

    rotate_store_attend(attn, rotary, positions, q, k, v, k_cache, v_cache, batch, head_norm, fold)
        -> attn.attend(rotary.forward_store_kv(positions, q, k, v, ...), k_cache, v_cache, batch)
           the rotary launch, then the attention's (and its combine launch for    by default
           groups of fewer than 8 query heads a kv head)
        -> decode_attention_rotary(positions, q, k, v, ...)
           the attention's split launch rotates its queries and writes the new keys
           (layers/kernels/triton_rotary_decode_attention.py), combine as above  when ``fold``
                                                                                  and the batch
                                                                                  qualifies

A batch qualifies when it is a decode batch (one new token a sequence), the attention runs its
Triton kernels (`Attention.uses_triton`: CUDA fp16 / bf16, a power-of-two head dim) and
batch-invariant mode is off (that mode's fixed key chunks stay with the split kernel). Any other
batch takes the rotary launch and the attention's own path, each reason logged once per process.
The two paths write the same cache bits and agree within rounding (the fused launch's docstring).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from arfusion.layers import batch_invariant
from arfusion.layers.attention import Attention, AttentionBatch
from arfusion.layers.head_norm import HeadNorm

if TYPE_CHECKING:
    from arfusion.layers.rotary_embedding import RotaryEmbedding

logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # the reasons logged so far (a fixed handful)


def fold_refusal(attn: Attention, q: torch.Tensor, batch: AttentionBatch) -> Optional[str]:
    """Why ``batch`` keeps the rotary launch apart (module docstring), or None when it folds."""
    if not batch.is_decode:
        return "a batch with prompt tokens (prefill, or a mixed step)"
    if not attn.uses_triton(q):
        return f"the torch attention path ({q.device.type}, {q.dtype}, head dim {attn.head_dim})"
    if batch_invariant.enabled():
        return "batch-invariant mode (its fixed key chunks)"
    return None


def rotate_store_attend(attn: Attention, rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
                        k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        batch: AttentionBatch, head_norm: Optional[HeadNorm], fold: bool) -> torch.Tensor:
    """``q [T, heads*d]``, ``k, v [T, kv_heads*d]`` (raw projections) -> the attention output
    ``[T, heads*d]``; writes the new keys (rotated) and values into ``k_cache``/``v_cache`` at
    ``batch.slot_mapping``, in place. One launch for a qualifying decode batch when ``fold``
    (module docstring), else `RotaryEmbedding.forward_store_kv` then `Attention.attend`."""
    if fold:
        reason = fold_refusal(attn, q, batch)
        if reason is None:
            from arfusion.layers.kernels.triton_rotary_decode_attention import decode_attention_rotary

            out = decode_attention_rotary(positions, q, k, v, rotary.inv_freq, batch.slot_mapping, k_cache, v_cache,
                                          batch.req_to_token, batch.seq_lens, attn.scale, head_norm=head_norm,
                                          row_ids=batch.row_ids, sinks=attn.sinks, window=attn.sliding_window)
            return out.reshape(q.shape[0], -1)
        if reason not in _LOGGED:
            _LOGGED.add(reason)
            logger.info("rotary into attention: %s keeps the rotary launch apart", reason)
    q = rotary.forward_store_kv(positions, q, k, v, batch.slot_mapping, k_cache, v_cache, head_norm)
    return attn.attend(q, k_cache, v_cache, batch)

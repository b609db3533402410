"""Causal attention over a token-slot KV cache, in torch (scaled_dot_product_attention).

For new token t of sequence i at position p (p = seq_lens[i] - extend_lens[i] + j for its j-th
new token), with the sequence's keys K_i = k_cache[req_to_token[r_i, :seq_lens[i]]] (its row
r_i = row_ids[i] when the batch has row ids, else i):

    out_t = softmax(q_t . K_i[:p+1]^T * scale) @ V_i[:p+1]

per query head, query head h reading KV head h // (num_heads / num_kv_heads) (GQA).
`Attention.forward` first writes the new keys and values to their slots (``slot_mapping``), in
place (`store_kv`), then attends (`Attention.attend`, which only reads the cache); a caller that
has already written them (the fused rotary kernel does) calls `attend` alone.

On GPU (fp16/bf16, power-of-two head dim, triton) both modes run Triton kernels: split-K decode
(layers/kernels/triton_decode_attention.py) and one flash-attention launch for a whole extend batch
(layers/kernels/triton_extend_attention.py). The torch paths, the references: decode batched with
static shapes (the sequences' keys gathered to ``[B, max_context, ...]`` and masked by
``seq_lens``), extend looping over the sequences, each with a bottom-right-aligned causal mask;
both in pieces of bounded size (`MAX_SCORES`), so a long prompt's attention takes bounded memory
on a CPU as the Triton kernels do on a GPU.

Batch-invariant mode (`layers.batch_invariant`): on GPU, decode splits each sequence's keys into
chunks of a fixed size (`DETERMINISTIC_KEYS_PER_SPLIT`: a sequence's split count depends on its
own length only, not on the batch, and the splits are added in order) and extend takes every key block through its masked step (``mask_all``: one program
per block of a sequence's tokens, over keys in blocks of a size fixed by dtype and head dim,
aligned at key 0, each block by one instruction sequence: a row's blocks and their order depend
on its position only, and blocks past it leave its running sums exactly as they were). On CPU
both run layers/batch_invariant_attention.py (fixed-shape GEMMs over key blocks aligned at key
0, the blocks added by a fixed tree), whose rows depend on nothing else (a prompt row and the
same position decoded give the same bits), in pieces within `MAX_SCORES` as the default path.
An extend batch whose first ``num_decodes`` sequences are decodes riding along with prompt
chunks (a mixed step) runs, in this mode, as two calls on its row ranges: the decodes as a decode
batch, the prompt chunks as an extend batch (`split_decodes`), so that every row's attention is
computed exactly as in a step of its own kind (on GPU the decode kernel and the extend kernel
add in different orders); with the mode off the whole batch is one extend call.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from arfusion.layers import batch_invariant
from arfusion.layers.batch_invariant_attention import attend_decode, attend_elementwise, attend_sequence
from arfusion.layers.sink_attention import attend_with_sinks
from arfusion.layers.kernels.triton_support import triton_available

# Batch-invariant mode on GPU: decode splits every sequence's keys into chunks of this many keys
# (ceil(length / this) splits: fewer for short sequences, more for long ones), whatever the batch
DETERMINISTIC_KEYS_PER_SPLIT = 256
# The torch paths compute attention in pieces whose largest intermediate (extend: the scores of
# a chunk of queries, [num_heads, queries, keys]; decode: a chunk of rows' keys expanded to every
# query head, [rows, num_heads, context, head_dim]) holds at most this many elements: 64 MiB in
# fp32, whatever the prompt's length (an 8k prompt's whole [heads, T, T] scores would be GBs).
MAX_SCORES = 1 << 24


class AttentionBatch(Protocol):
    """The batch fields attention reads (engine.models.forward_batch.ForwardBatch has them)."""

    @property
    def is_decode(self) -> bool: ...

    seq_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [T]
    req_to_token: torch.Tensor  # [B, max_context], or [R, max_context] with row_ids
    row_ids: Optional[torch.Tensor]  # [B]: sequence i's row of req_to_token (None: row i)
    max_extend_len: Optional[int]  # host int >= max(extend_lens), or None (read from the device)
    num_decodes: int  # an extend batch: its first num_decodes sequences are decodes (one new token each)


@dataclasses.dataclass(frozen=True)
class BatchPart:
    """Some sequences of an `AttentionBatch`, as a batch of their own (`split_decodes`)."""

    is_decode: bool
    seq_lens: torch.Tensor
    extend_lens: torch.Tensor
    slot_mapping: torch.Tensor
    req_to_token: torch.Tensor
    row_ids: Optional[torch.Tensor]
    max_extend_len: Optional[int]
    num_decodes: int = 0


def split_decodes(batch: AttentionBatch) -> tuple[BatchPart, BatchPart]:
    """An extend batch whose first ``d = batch.num_decodes`` sequences (0 < d < B) are decodes:
    ``(a decode batch of sequences [0, d), an extend batch of sequences [d, B))``, views of its
    tensors (the decodes' new tokens are the first d of the packed T)."""
    d = batch.num_decodes
    if not 0 < d < batch.seq_lens.shape[0]:
        raise ValueError(f"need 0 < num_decodes < {batch.seq_lens.shape[0]} sequences, got {d}")

    def part(rows: slice, decode: bool) -> BatchPart:  # sequences ``rows``, whose tokens are ``rows`` too
        by_row = batch.row_ids is not None
        return BatchPart(decode, batch.seq_lens[rows], batch.extend_lens[rows], batch.slot_mapping[rows],
                         batch.req_to_token if by_row else batch.req_to_token[rows],
                         batch.row_ids[rows] if by_row else None, 1 if decode else batch.max_extend_len)

    return part(slice(0, d), True), part(slice(d, None), False)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """In place: ``k_cache[slot_mapping[t]] = k[t]`` and ``v_cache[slot_mapping[t]] = v[t]`` for the
    T new tokens (``k, v [T, kv_heads*head_dim]``, caches ``[num_slots, kv_heads, head_dim]``,
    ``slot_mapping [T]`` int64)."""
    k_cache.index_copy_(0, slot_mapping, k.reshape(k.shape[0], *k_cache.shape[1:]))
    v_cache.index_copy_(0, slot_mapping, v.reshape(v.shape[0], *v_cache.shape[1:]))


def _sequence_slots(batch: AttentionBatch) -> torch.Tensor:
    """``[B, max_context]``: each sequence's row of ``req_to_token`` (gathered through ``row_ids``)."""
    return batch.req_to_token if batch.row_ids is None else batch.req_to_token[batch.row_ids]


class Attention(nn.Module):
    """Attention of this rank's ``num_heads`` query heads over its ``num_kv_heads`` KV heads.
    ``sinks``: a learned fp32 logit per local query head that joins every softmax's denominator
    (gpt-oss; a parameter ``sinks [num_heads]`` the model loads); ``sliding_window`` W > 0: a
    query sees only the W latest keys, itself included. Either one routes to
    layers/sink_attention.py's math (the Triton kernels' ``sinks`` / ``window`` on GPU)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sinks: bool = False,
                 sliding_window: int = 0, device: Optional[torch.device] = None) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.max_scores = MAX_SCORES  # the torch paths' largest intermediate, in elements (see MAX_SCORES)
        self.sliding_window = sliding_window
        self.sinks = (nn.Parameter(torch.empty(num_heads, dtype=torch.float32, device=device), requires_grad=False)
                      if sinks else None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """``q [T, num_heads*head_dim]``, ``k, v [T, num_kv_heads*head_dim]`` -> ``[T, num_heads*head_dim]``.
        Writes k and v into ``k_cache``/``v_cache`` ``[num_slots, num_kv_heads, head_dim]`` at
        ``batch.slot_mapping`` (`store_kv`), then `attend`."""
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        return self.attend(q, k_cache, v_cache, batch)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               batch: AttentionBatch) -> torch.Tensor:
        """``q [T, num_heads*head_dim]`` -> ``[T, num_heads*head_dim]`` over the cache, whose slots
        must already hold the new tokens' keys and values. Reads the cache only. In
        batch-invariant mode an extend batch with ``num_decodes`` runs as a decode call on its
        first rows and an extend call on the rest (`split_decodes`)."""
        tokens = q.shape[0]
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        if batch.is_decode:
            out = self._decode(q, k_cache, v_cache, batch)
        elif batch_invariant.enabled() and batch.num_decodes:
            decodes, prompts = split_decodes(batch)
            d = batch.num_decodes
            out = torch.empty_like(q)
            out[:d] = self._decode(q[:d], k_cache, v_cache, decodes)
            out[d:] = self._extend(q[d:], k_cache, v_cache, prompts)
        else:
            out = self._extend(q, k_cache, v_cache, batch)
        return out.reshape(tokens, self.num_heads * self.head_dim)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """One query per sequence. On GPU (fp16/bf16, power-of-two head dim): the Triton split-K
        kernel, which reads only each sequence's own keys; elsewhere `_decode_torch`."""
        if self.uses_triton(q):
            from arfusion.layers.kernels.triton_decode_attention import decode_attention

            keys_per_split = DETERMINISTIC_KEYS_PER_SPLIT if batch_invariant.enabled() else None
            return decode_attention(q, k_cache, v_cache, batch.req_to_token, batch.seq_lens, self.scale,
                                    row_ids=batch.row_ids, keys_per_split=keys_per_split, sinks=self.sinks,
                                    window=self.sliding_window)
        if batch_invariant.enabled() or self._sink_or_window:
            return self._attend_per_sequence(q, k_cache, v_cache, batch)
        return self._decode_torch(q, k_cache, v_cache, batch)

    def _decode_torch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: AttentionBatch) -> torch.Tensor:
        """Keys ``[b, kv_heads, max_context, head_dim]`` gathered for b rows at a time (as many as
        keep ``b * num_heads * max_context * head_dim`` within ``max_scores``, at least one) and
        masked to ``seq_lens``."""
        slots = _sequence_slots(batch)
        context = slots.shape[1]
        rows = max(1, self.max_scores // (self.num_heads * context * self.head_dim))
        out = torch.empty_like(q)
        positions = torch.arange(context, device=q.device)
        for b0 in range(0, q.shape[0], rows):
            b1 = min(q.shape[0], b0 + rows)
            keys = k_cache[slots[b0:b1]].transpose(1, 2)
            values = v_cache[slots[b0:b1]].transpose(1, 2)
            valid = positions[None, :] < batch.seq_lens[b0:b1, None]  # [b, C]
            out[b0:b1] = F.scaled_dot_product_attention(
                q[b0:b1].unsqueeze(2), keys, values, attn_mask=valid[:, None, None, :], scale=self.scale,
                enable_gqa=True).squeeze(2)  # [b, heads, 1, head_dim] -> [b, heads, head_dim]
        return out

    def uses_triton(self, q: torch.Tensor) -> bool:
        """GPU, fp16/bf16, power-of-two head dim >= 16, triton importable: the Triton kernels run."""
        pow2_head = self.head_dim >= 16 and self.head_dim & (self.head_dim - 1) == 0
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and pow2_head and triton_available()

    def _extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor:
        """Every sequence's new queries against all its keys, causal with the cached prefix
        visible. Where `uses_triton`: one Triton flash-attention launch for the whole batch
        (layers/kernels/triton_extend_attention.py); elsewhere `_extend_torch`."""
        if self.uses_triton(q):
            from arfusion.layers.kernels.triton_extend_attention import extend_attention

            return extend_attention(q, k_cache, v_cache, batch.req_to_token, batch.seq_lens, batch.extend_lens,
                                    self.scale, row_ids=batch.row_ids, max_extend_len=batch.max_extend_len,
                                    mask_all=batch_invariant.enabled(), sinks=self.sinks, window=self.sliding_window)
        if batch_invariant.enabled() or self._sink_or_window:
            return self._attend_per_sequence(q, k_cache, v_cache, batch)
        return self._extend_torch(q, k_cache, v_cache, batch)

    @property
    def _sink_or_window(self) -> bool:
        return self.sinks is not None or self.sliding_window > 0

    def _attend_per_sequence(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             batch: AttentionBatch) -> torch.Tensor:
        """Batch-invariant mode, or sinks / a window, off the Triton path: with sinks or a window
        by `attend_with_sinks` (a decode batch in one call, each row over its own keys padded to
        the longest sequence, or on a GPU to the table's width); otherwise
        (layers/batch_invariant_attention.py) on a CPU a decode batch by `attend_decode` and an
        extend batch one sequence at a time by `attend_sequence`, both within ``max_scores``, and
        on a CUDA device by `attend_elementwise`, a decode batch in one call over the table's whole
        width (no host sync, so a CUDA graph can capture it). An extend batch goes one sequence at
        a time (its new queries, the last ``extend_lens[i]`` of ``seq_lens[i]``)."""
        seq_slots = _sequence_slots(batch)
        if self._sink_or_window:
            attend = functools.partial(attend_with_sinks, scale=self.scale, sinks=self.sinks,
                                       window=self.sliding_window)
            if batch.is_decode:  # on a GPU the whole width: no host sync, so a CUDA graph can capture it
                longest = seq_slots.shape[1] if q.is_cuda else int(batch.seq_lens.max())
                slots = seq_slots[:, :longest]
                return attend(q, k_cache[slots], v_cache[slots], batch.seq_lens - 1)
        elif batch.is_decode and q.is_cuda:
            return attend_elementwise(q, k_cache[seq_slots], v_cache[seq_slots], batch.seq_lens - 1, self.scale)
        elif batch.is_decode:
            return attend_decode(q, k_cache, v_cache, seq_slots, batch.seq_lens, self.scale, self.max_scores)
        else:
            attend = (functools.partial(attend_elementwise, scale=self.scale) if q.is_cuda else
                      functools.partial(attend_sequence, scale=self.scale, max_scores=self.max_scores))
        out = torch.empty_like(q)
        start = 0
        for i, (seq_len, new) in enumerate(zip(batch.seq_lens.tolist(), batch.extend_lens.tolist())):
            slots = seq_slots[i, :seq_len]
            positions = torch.arange(seq_len - new, seq_len, device=q.device)
            out[start:start + new] = attend(q[start:start + new], k_cache[slots], v_cache[slots], positions)
            start += new
        return out

    def _extend_torch(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      batch: AttentionBatch) -> torch.Tensor:
        """Per sequence: its new queries against all its keys, causal with the cached prefix
        visible, in chunks of queries whose scores ``[num_heads, queries, keys]`` hold at most
        ``max_scores`` elements (at least one query; each chunk reads only the keys up to its
        last query)."""
        out = torch.empty_like(q)
        seq_slots = _sequence_slots(batch)
        start = 0
        for i, (seq_len, new) in enumerate(zip(batch.seq_lens.tolist(), batch.extend_lens.tolist())):
            slots = seq_slots[i, :seq_len]
            ki = k_cache[slots].transpose(0, 1)  # [kv_heads, seq_len, head_dim]
            vi = v_cache[slots].transpose(0, 1)
            prefix = seq_len - new
            rows = max(1, self.max_scores // (self.num_heads * seq_len))
            for j0 in range(0, new, rows):
                j1 = min(new, j0 + rows)
                qc = q[start + j0:start + j1].transpose(0, 1)  # [heads, j1 - j0, head_dim]
                keys = prefix + j1  # the chunk's last query sees keys [0, keys)
                if j0 == 0 and j1 == new == seq_len:  # a whole prompt: the square causal mask
                    oc = F.scaled_dot_product_attention(qc, ki, vi, is_causal=True, scale=self.scale, enable_gqa=True)
                else:
                    query_pos = torch.arange(prefix + j0, keys, device=q.device)
                    mask = torch.arange(keys, device=q.device)[None, :] <= query_pos[:, None]  # [j1 - j0, keys]
                    oc = F.scaled_dot_product_attention(qc, ki[:, :keys], vi[:, :keys], attn_mask=mask,
                                                        scale=self.scale, enable_gqa=True)
                out[start + j0:start + j1] = oc.transpose(0, 1)
            start += new
        return out

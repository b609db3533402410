"""`greedy_tokens`: the argmax of each row of ``[B, vocab]`` logits in two parallel stages.

``torch.argmax`` over one long row reduces it in a single thread block: 26 µs per decode step
for one row of 128256 fp32 logits on an H200 (profile in docs/results.md), about 1% of a
batch-1 step. Cutting each row into C chunks (a divisor of vocab, at most MAX_CHUNKS) gives B*C
short reductions, then an argmax over the C chunk maxima:

    m[b, c], j[b, c] = max/argmax of logits[b, c*L:(c+1)*L]     (L = vocab / C)
    c*[b]            = argmax_c m[b, c]
    token[b]         = c*[b] * L + j[b, c*[b]]

Ties resolve like ``torch.argmax`` (the lowest index): within a chunk the first maximum is
kept, and among chunks the first chunk holding the row maximum. NaN rows follow torch's max
(a NaN is the maximum). No host sync; inputs are not modified.
"""
from __future__ import annotations

import functools

import torch

MAX_CHUNKS = 256


@functools.lru_cache(maxsize=64)
def chunk_count(vocab: int) -> int:
    """The largest divisor of ``vocab`` not above MAX_CHUNKS (1 for a prime vocab)."""
    return max(c for c in range(1, min(MAX_CHUNKS, vocab) + 1) if vocab % c == 0)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``[B]`` int64: the index of each row's maximum (first on ties)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    batch, vocab = logits.shape
    chunks = chunk_count(vocab)
    if chunks == 1 or batch == 0:
        return torch.argmax(logits, dim=-1)
    length = vocab // chunks
    maxima, inner = logits.view(batch, chunks, length).max(dim=-1)
    best_chunk = torch.argmax(maxima, dim=-1, keepdim=True)
    return best_chunk.squeeze(1) * length + inner.gather(1, best_chunk).squeeze(1)

"""Log-probabilities of chosen tokens under the model's distribution: the full-vocabulary fp32
log-softmax of the raw logits (before penalties, bias or temperature).

For N rows of logits ``x [N, V]`` (gathered over the TP ranks' vocabulary slices) and a chosen
token ``t_i`` per row:

    logprob_i = x[i, t_i] - logsumexp_v x[i, v]        top_k: the k largest of row i, descending

Prompt tokens (``echo``): the logits at prompt position p score prompt token p + 1, so a prefill
chunk of positions ``[start, end)`` scores the tokens ``[start + 1, end + 1)``; its last row
scores the next chunk's first token, or is the row that samples the first output token when the
chunk ends the prompt. `prompt_logprobs` computes them from the chunk's hidden states in pieces
of at most ``MAX_GATHERED`` logits (each piece: the LM head, a gather of the vocabulary shards at
TP > 1, the log-softmax), so an echoed prompt of thousands of tokens never holds its ``[T, V]``
logits at once. In batch-invariant mode the log-softmax is `layers.batch_invariant.log_softmax`
(its sum a fixed tree: a row's bits never depend on the other rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from arfusion.layers import batch_invariant
from arfusion.layers.sharded_logits import gather_vocab

MAX_GATHERED = 1 << 24  # fp32 logits gathered at once for prompt log-probabilities (64 MiB)


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of N chosen tokens, on the device or the host."""

    logprobs: torch.Tensor  # fp32 [N]: each chosen token's
    top_ids: torch.Tensor  # int64 [N, k]: the k most likely tokens, most likely first
    top_logprobs: torch.Tensor  # fp32 [N, k]

    def to_host(self, pinned: bool) -> "TokenLogprobs":
        """A copy started on the current stream (into pinned memory when ``pinned``; complete once
        the stream has passed this point)."""
        def copy(t: torch.Tensor) -> torch.Tensor:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
            host.copy_(t, non_blocking=pinned)
            return host
        return TokenLogprobs(copy(self.logprobs), copy(self.top_ids), copy(self.top_logprobs))

    @staticmethod
    def cat(parts: Sequence["TokenLogprobs"]) -> "TokenLogprobs":
        return TokenLogprobs(torch.cat([p.logprobs for p in parts]), torch.cat([p.top_ids for p in parts]),
                             torch.cat([p.top_logprobs for p in parts]))


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_k: int) -> TokenLogprobs:
    """``logits`` fp32 ``[N, V]``, ``tokens`` int64 ``[N]`` (the chosen ones) -> their
    log-probabilities and each row's ``top_k`` most likely tokens (the module docstring)."""
    if batch_invariant.enabled():
        logp = batch_invariant.log_softmax(logits)
    else:
        logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1)
    top_logprobs, top_ids = torch.topk(logp, top_k, dim=-1)
    return TokenLogprobs(chosen, top_ids, top_logprobs)


def prompt_logprobs(hidden: torch.Tensor, targets: Sequence[int], top_k: int,
                    local_logits: Callable[[torch.Tensor], torch.Tensor], vocab_size: int,
                    rank0: bool) -> Optional[TokenLogprobs]:
    """Collective over the TP group: the log-probabilities of ``targets[i]`` under the logits of
    ``hidden[i]`` (``[len(targets), hidden]``, a prefill chunk's rows that score prompt tokens),
    with ``top_k`` alternatives; ``local_logits``: this rank's vocabulary slice of the LM head.
    Every rank runs the same pieces (the module docstring); rank 0 returns the result, the
    others None."""
    rows = max(1, MAX_GATHERED // vocab_size)
    wanted = torch.tensor(list(targets), dtype=torch.int64).to(hidden.device, non_blocking=True)
    parts = []
    for start in range(0, len(targets), rows):
        full = gather_vocab(local_logits(hidden[start:start + rows]))
        if rank0:
            parts.append(token_logprobs(full, wanted[start:start + rows], top_k))
    return TokenLogprobs.cat(parts) if rank0 else None

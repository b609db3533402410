"""Vocabulary-parallel embedding and LM head.

Rank r holds rows ``[r*V/tp, (r+1)*V/tp)`` of the ``[V, hidden]`` embedding table.

    VocabParallelEmbedding  e = sum over ranks of (E_r[id - start_r] if id in rank r's range else 0)
                            (a masked local lookup, then an all-reduce over the TP group)
    ParallelLMHead          logits = concat over ranks of (h @ E_r^T) = [N, V]: each rank keeps
                            its slice h @ E_r^T, with the greedy tokens of the whole vocabulary
                            (`layers.sharded_logits`); its weight is its own or the embedding's
                            (tied word embeddings); ids past the tokenizer's vocabulary (a
                            padded table) can be masked: logit -inf
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from arfusion.layers import batch_invariant
from arfusion.layers.linear import ShardId, check_shape, divide
from arfusion.layers.parallel_state import get_tp_group
from arfusion.layers.sharded_logits import ShardedLogits, sharded_logits


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over TP ranks (``num_embeddings`` must divide).
    ``shared_weight``: use this (already sharded) parameter instead of allocating one."""

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None, shared_weight: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = group.rank, group.world_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = divide(num_embeddings, self.tp_size, "vocab size")
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        shape = (self.num_embeddings_per_partition, embedding_dim)
        if shared_weight is not None:
            if tuple(shared_weight.shape) != shape:
                raise ValueError(f"shared weight has shape {tuple(shared_weight.shape)}, expected {shape}")
            self.weight = shared_weight
            return
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        """Rows ``[vocab_start, vocab_end)`` of the full ``[V, hidden]`` table."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard id, got {shard_id!r}")
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        param.data.copy_(loaded.narrow(0, self.vocab_start, self.num_embeddings_per_partition))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]``: masked local lookup, then an in-place all-reduce."""
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * in_range
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return get_tp_group().all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """``logits = h @ E^T`` over the full vocabulary, each rank computing its vocabulary slice.
    With ``tied`` the head shares (and loads through) that embedding's weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tied: Optional[VocabParallelEmbedding] = None,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        shared = None if tied is None else tied.weight
        super().__init__(num_embeddings, embedding_dim, dtype, device, shared_weight=shared)
        self.sampled_vocab = num_embeddings  # ids from this on have logit -inf (`mask_ids_from`)

    def mask_ids_from(self, vocab_size: int) -> None:
        """From now on the ids ``>= vocab_size`` (rows padding the table beyond the tokenizer's
        vocabulary) get the logit -inf: never sampled, probability 0."""
        self.sampled_vocab = min(vocab_size, self.num_embeddings)

    def forward(self, hidden_states: torch.Tensor) -> ShardedLogits:
        """Collective: ``[N, hidden] ->`` this rank's logits ``h @ E_r^T [N, V/tp]`` and the
        greedy tokens of the whole vocabulary; ``.gather()`` gives the full ``[N, V]``."""
        return sharded_logits(self.local_logits(hidden_states), self.vocab_start)

    def local_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] ->`` this rank's slice ``h @ E_r^T [N, V/tp]`` alone (no collective),
        with -inf in the columns of ids ``>= sampled_vocab``."""
        logits = batch_invariant.linear(hidden_states, self.weight)
        masked_from = max(self.sampled_vocab - self.vocab_start, 0)
        if masked_from < self.num_embeddings_per_partition:
            logits[:, masked_from:] = float("-inf")
        return logits

"""The logits of one step as the TP ranks hold them after the LM head, and the greedy token
taken from them without gathering them.

Rank r of tp holds ``local_r = h @ E_r^T``, columns ``[start_r, start_r + V/tp)`` of the logits
``[B, V]`` (`layers.vocab_parallel_embedding.ParallelLMHead`). For row b:

    argmax_v logits[b, v] = start_r* + argmax local_r*[b],
        r* = the lowest rank whose row maximum m_r = max local_r[b] equals max over ranks of m_r

Every rank reduces its own slice to the pair (m_r, start_r + argmax local_r[b]), the ranks
all-gather the ``[B, 2]`` pairs (8 bytes per row and rank instead of V/tp logits), and each
picks the same winner. Taking the lowest rank among equal maxima keeps torch.argmax's
first-occurrence rule, so the token equals ``argmax`` of the gathered logits exactly; ids travel
as fp32, exact below 2^24. The row maximum itself is taken in two levels (`_row_max`): with
few rows, one reduction per row leaves most of the GPU idle.

Only a step that needs the whole distribution (sampling with a temperature, logits processing,
log-probabilities) gathers it: `gather_vocab` all-gathers the slices into fp32 ``[B, V]`` (a
collective every rank must call).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from arfusion.layers.parallel_state import get_tp_group

MAX_CHUNKS = 256  # first-level pieces per row of the two-level row maximum
MAX_VOCAB = 2 ** 24  # token ids travel as fp32: exact below this


@dataclass(frozen=True)
class ShardedLogits:
    """One step's logits on one rank: its vocabulary slice and the whole vocabulary's argmax."""

    local: torch.Tensor  # [B, V/tp], model dtype: this rank's vocabulary slice
    greedy_tokens: torch.Tensor  # [B] int64: the argmax over the whole vocabulary, the same on every rank

    def __getitem__(self, rows: slice) -> "ShardedLogits":
        return ShardedLogits(self.local[rows], self.greedy_tokens[rows])

    def gather(self) -> torch.Tensor:
        """Collective over the TP group: fp32 ``[B, V]`` (`gather_vocab` of ``local``)."""
        return gather_vocab(self.local)


def gather_vocab(local: torch.Tensor) -> torch.Tensor:
    """Collective over the TP group: fp32 ``[N, V]`` from every rank's slice ``local [N, V/tp]``,
    in rank order."""
    group = get_tp_group()
    if group.world_size == 1:
        return local.float()
    parts = [torch.empty_like(local) for _ in range(group.world_size)]
    dist.all_gather(parts, local.contiguous(), group=group.device_group)
    return torch.cat(parts, dim=-1).float()


def _chunks(width: int) -> int:
    """The largest power of two <= MAX_CHUNKS that divides ``width`` (1 if it is odd)."""
    chunks = MAX_CHUNKS
    while width % chunks:
        chunks //= 2
    return chunks


def _row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max, first index of the max)`` of each row of ``x [B, N]``, in two levels: the max of
    each of c equal pieces of a row (B*c reductions in parallel), then the first piece holding
    the largest of those. The first maximum of the first such piece is the row's first maximum."""
    rows, width = x.shape
    chunks = _chunks(width)
    piece_max, piece_arg = torch.max(x.reshape(rows, chunks, width // chunks), dim=-1)  # [B, c]
    best, piece = torch.max(piece_max, dim=-1)  # [B]: first piece holding the row max
    return best, piece * (width // chunks) + piece_arg.gather(1, piece[:, None]).squeeze(1)


def sharded_logits(local: torch.Tensor, vocab_start: int) -> ShardedLogits:
    """Collective over the TP group: wrap this rank's slice ``local [B, V/tp]`` (columns from
    ``vocab_start``) with the greedy tokens of the whole vocabulary (see the module docstring).
    No host sync; CUDA-graph capturable. Raises ValueError above MAX_VOCAB ids over TP ranks."""
    group = get_tp_group()
    best, index = _row_max(local)
    if group.world_size == 1:
        return ShardedLogits(local, index)
    vocab = local.shape[-1] * group.world_size
    if vocab > MAX_VOCAB:
        raise ValueError(f"a vocabulary of {vocab} ids does not fit the fp32 token ids of the sharded argmax "
                         f"(at most {MAX_VOCAB})")
    pair = torch.stack([best.float(), (index + vocab_start).float()], dim=-1)  # [B, 2]
    pairs = torch.empty((group.world_size * pair.shape[0], 2), dtype=pair.dtype, device=pair.device)
    group.all_gather_into(pairs, pair)  # capturable where the group has a stand-in for gloo
    pairs = pairs.view(group.world_size, -1, 2)
    winner = torch.argmax(pairs[:, :, 0], dim=0)  # [B]: the lowest rank holding the max
    tokens = pairs[:, :, 1].gather(0, winner[None, :]).squeeze(0).long()
    return ShardedLogits(local, tokens)

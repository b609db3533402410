"""Logits processing on TP rank 0, batched on the device: ``min_tokens``, ``logit_bias`` and
the presence / frequency / repetition penalties (their semantics: `SamplingParams`).

`TokenHistory` keeps, for each running request with a penalty, what the penalties read: the
count of every token in its output (int32 ``[V]``) and the mask of the tokens in its prompt
(bool ``[V]``), as rows of two device tensors. The counts are updated on the device from each
step's sampled tokens (`record`), so a step launched before the previous step's tokens reached
the host (the overlap schedule) still sees them.

`process_logits` changes a step's fp32 logits ``[B, V]`` in place with a few tensor operations
over the whole batch (the host only lists which rows and token ids are involved):

    banned (rows below their min_tokens, their stop ids)      logits[r, t] = -inf
    logit_bias (row r, token t, bias b)                         logits[r, t] += b
    penalised rows r, with counts c = output counts, seen = prompt mask | (c > 0):
        logits[r] = where(seen, where(logits > 0, logits / rep, logits * rep), logits)
                    - frequency * c - presence * (c > 0)

and clamps the penalised rows to fp32's finite maximum (a tiny repetition penalty divides).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from arfusion.engine.common.sampling_params import SamplingParams

FIRST_ROWS = 8  # rows of a new `TokenHistory`; it doubles when full


class TokenHistory:
    """Per-request token statistics for the penalties, on ``device`` (see the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free: list[int] = []

    def add(self, prompt_ids: Sequence[int]) -> int:
        """A row for a new request: no output yet, its prompt's tokens marked (ids outside the
        vocabulary are ignored). Stream-ordered after every earlier `record`."""
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.counts[row].zero_()
        self.prompt[row].zero_()
        ids = torch.tensor([t for t in prompt_ids if 0 <= t < self.vocab_size], dtype=torch.int64)
        self.prompt[row, ids.to(self.device, non_blocking=True)] = True
        return row

    def remove(self, row: int) -> None:
        self._free.append(row)

    def record(self, rows: Sequence[int], tokens: torch.Tensor) -> None:
        """In place: ``counts[rows[i], tokens[i]] += 1`` (``tokens``: int64 ``[len(rows)]`` on the device)."""
        if rows:
            index = torch.tensor(list(rows), dtype=torch.int64).to(self.device, non_blocking=True)
            one = torch.ones(1, dtype=torch.int32, device=self.device).expand(len(rows))
            self.counts.index_put_((index, tokens), one, accumulate=True)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(FIRST_ROWS, 2 * old)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        prompt = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], prompt[:old] = self.counts, self.prompt
        self.counts, self.prompt = counts, prompt
        self._free.extend(range(new - 1, old - 1, -1))


@dataclass(frozen=True)
class RowState:
    """What processing one row of a step needs beside its `SamplingParams`."""

    generated: int = 0  # output tokens sampled before this one
    history_row: Optional[int] = None  # its `TokenHistory` row (requests with a penalty)


def process_logits(logits: torch.Tensor, params: Sequence[SamplingParams], states: Sequence[RowState],
                   eos_ids: Sequence[int], history: Optional[TokenHistory]) -> None:
    """Apply each row's min_tokens ban, logit_bias and penalties to ``logits`` (fp32 ``[B, V]``,
    in place; the module docstring has the math). ``eos_ids``: the ids a min_tokens ban covers
    besides a row's stop_token_ids (unless it ignores EOS). Raises ValueError for a row with a
    penalty but no history row."""
    vocab = logits.shape[-1]
    ban_rows, ban_ids, bias_rows, bias_ids, bias = [], [], [], [], []
    for i, (p, s) in enumerate(zip(params, states)):
        if s.generated < p.min_tokens:
            stops = p.stop_token_set if p.ignore_eos else p.stop_token_set.union(eos_ids)
            ids = sorted(t for t in stops if 0 <= t < vocab)
            ban_rows += [i] * len(ids)
            ban_ids += ids
        bias_rows += [i] * len(p.logit_bias)
        bias_ids += [t for t, _ in p.logit_bias]
        bias += [b for _, b in p.logit_bias]
    dev = logits.device
    if ban_rows:
        logits[_ids(ban_rows, dev), _ids(ban_ids, dev)] = float("-inf")
    if bias_rows:
        values = torch.tensor(bias, dtype=torch.float32).to(dev, non_blocking=True)
        logits.index_put_((_ids(bias_rows, dev), _ids(bias_ids, dev)), values, accumulate=True)
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if penalised:
        if history is None or any(states[i].history_row is None for i in penalised):
            raise ValueError("a row with a penalty needs its TokenHistory row")
        apply_penalties(logits, _ids(penalised, dev), history, [states[i].history_row for i in penalised],
                        [params[i] for i in penalised])


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, history: TokenHistory, history_rows: list[int],
                    params: Sequence[SamplingParams]) -> None:
    """In place, rows ``rows`` of ``logits``: the repetition, frequency and presence penalties
    of ``params`` (one per row) over the history rows ``history_rows``."""
    dev = logits.device
    per_row = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
                           dtype=torch.float32).to(dev, non_blocking=True)
    repetition, frequency, presence = (per_row[:, k:k + 1] for k in range(3))
    hist = _ids(history_rows, dev)
    counts = history.counts[hist].float()
    occurred = counts > 0
    seen = history.prompt[hist] | occurred
    x = logits[rows]
    scaled = torch.where(x > 0, x / repetition, x * repetition)
    x = torch.where(seen, scaled, x) - frequency * counts - presence * occurred
    logits[rows] = x.clamp(max=torch.finfo(torch.float32).max)


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

"""Next-token sampling from fp32 logits ``[B, vocab]`` (TP rank 0 only).

Greedy rows take ``argmax``. Other rows: ``softmax(logits / temperature)`` restricted to the
``top_k`` largest and then to the smallest set whose probability reaches ``top_p`` (the
token that crosses ``top_p`` is kept), renormalised, sampled with the request's own
``torch.Generator`` (seeded from its ``seed``, else from the engine's seed and its id), so a
seeded request gives the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from engine.sampling_params import SamplingParams


def filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """``[vocab]`` probabilities of one row after temperature, top-k and top-p."""
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = torch.sort(probs, descending=True)
    if top_k > 0:
        sorted_probs[top_k:] = 0
    if top_p < 1.0:
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly better tokens
        sorted_probs[before >= top_p] = 0
    out = torch.zeros_like(probs)
    out[order] = sorted_probs
    return out / out.sum()


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """One next token per row of ``logits``."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = filtered_probs(logits[i].float().cpu(), p.temperature, p.top_k, p.top_p)
        tokens[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return tokens

"""Next-token sampling (TP rank 0 only) from a step's `StepLogits`, batched on the device.

Greedy rows take the step's greedy tokens (the argmax over the vocabulary, found without
gathering the logits: `layers.sharded_logits`), or the argmax of their processed logits when
they have penalties, a logit bias or a min_tokens ban (`engine.runtime.logits_processors`).
Other rows need the step's full fp32 logits ``[B, vocab]`` (gathered when the step's plan asked
for them, ``StepPlan.gather_logits``), processed the same way first:
``softmax(logits / temperature)`` restricted to the ``top_k`` largest and then to the smallest
set whose probability reaches ``top_p`` (the token that crosses ``top_p`` is kept, so the most
likely token always is), renormalised, and sampled by inverse CDF: the first token of
the sorted distribution whose cumulative probability exceeds ``u * total``. ``u`` comes from
the request's own ``torch.Generator`` on the CPU (seeded from its ``seed``, else from the
engine's seed and its id), so a seeded request gives the same tokens whatever else is in the
batch, while the filtering and the search run for all rows at once on the GPU.

Edge values mean their limits: a ``top_p`` too small for fp32 (below 1.4e-45 it rounds to 0)
keeps the most likely token alone (greedy); a temperature beyond fp32's largest finite value
(3.4e38, which would divide into inf, and a banned token's -inf / inf into NaN) is that largest
value, which makes every allowed token equally likely (|logit| / 3.4e38 rounds to 0) and keeps a
banned one at probability 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.runtime.logprobs import TokenLogprobs

FP32_MAX = torch.finfo(torch.float32).max  # temperatures above it divide as it does (see above)


@dataclass(frozen=True)
class StepLogits:
    """What a forward step gives the sampler, on the device."""

    greedy_tokens: torch.Tensor  # [B] int64: argmax of each row over the whole vocabulary
    full: Optional[torch.Tensor] = None  # fp32 [B, vocab]: only when the step gathered it
    prompt: tuple[TokenLogprobs, ...] = ()  # TP rank 0: one per entry of the plan's prompt_logprobs


def filtered_sorted_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs sorted descending with filtered entries zeroed, the token ids in that order)``
    for rows ``[R, vocab]`` with per-row ``temperature``, ``top_k`` (<= 0: all) and ``top_p``."""
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    keep_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly better tokens
    keep_p = (before < top_p[:, None]) | (rank == 0)
    return sorted_probs * (keep_k & keep_p), order


def sample(step: StepLogits, params: Sequence[SamplingParams], generators: Sequence[Optional[torch.Generator]],
           processed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One next token per row: int64 ``[B]`` on the device, computed without a host sync (the
    random numbers come from the CPU generators). ``processed``: the step's fp32 logits ``[B,
    vocab]`` after `engine.runtime.logits_processors.process_logits`, needed when some row
    processes its logits; such a row takes the argmax of its processed logits (greedy) or samples
    from them. With no sampled or processed row, the result is the step's ``greedy_tokens``
    tensor itself (valid until the next forward: a replayed graph's output), else a new tensor.
    Raises ValueError if a row samples but the step has no full logits, or a row processes its
    logits but ``processed`` is None."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    argmax_rows = [i for i, p in enumerate(params) if p.greedy and p.processes_logits]
    if not rows and not argmax_rows:
        return step.greedy_tokens
    if step.full is None:
        raise ValueError(f"{len(rows) + len(argmax_rows)} row(s) sample with a temperature or process their logits, "
                         "but the step did not gather its logits (StepPlan.gather_logits)")
    if processed is None and any(params[i].processes_logits for i in rows + argmax_rows):
        raise ValueError("rows process their logits, but no processed logits were given")
    logits = step.full if processed is None else processed
    tokens = step.greedy_tokens.clone()  # a replayed graph's output buffer: do not write into it
    if argmax_rows:
        tokens[argmax_rows] = logits[argmax_rows].argmax(dim=-1)
    if not rows:
        return tokens
    dev = logits.device
    sub = [params[i] for i in rows]
    temperature = torch.tensor([min(p.temperature, FP32_MAX) for p in sub], device=dev, dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in sub], device=dev)
    top_p = torch.tensor([p.top_p for p in sub], device=dev, dtype=torch.float32)
    uniform = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).to(dev)
    probs, order = filtered_sorted_probs(logits[rows], temperature, top_k, top_p)
    cdf = torch.cumsum(probs, dim=-1)
    target = uniform[:, None] * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True).clamp_max(cdf.shape[-1] - 1)
    tokens[rows] = order.gather(1, pick).squeeze(1)
    return tokens

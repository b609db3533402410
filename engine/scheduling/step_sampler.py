"""`StepSampler`: a step's next tokens for the scheduler (TP rank 0), with what the requests
asked for beside them: logits processing (`engine.runtime.logits_processors`, with the token
history the penalties read, kept on the device) and the sampled tokens' log-probabilities.

Isolation: when sampling the batch fails, each sampled or processed row is tried alone (on a
copy of its generator); the requests whose rows fail are failed alone (``fail``), their rows
take the greedy token (dropped: the request has finished), and the rest are sampled again. A
fault computing the log-probabilities fails the requests that asked for them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from arfusion.engine.common.generation import EngineError, TokenLogprob
from arfusion.engine.common.sampling_params import SamplingParams
from arfusion.engine.runtime.logits_processors import RowState, TokenHistory, process_logits
from arfusion.engine.runtime.logprobs import TokenLogprobs, token_logprobs
from arfusion.engine.runtime.sampler import StepLogits, sample
from arfusion.engine.scheduling.request import Request

logger = logging.getLogger(__name__)
GREEDY = SamplingParams(temperature=0)


@dataclass
class SampledStep:
    """A step's next tokens ``[B]`` on the device, and the log-probabilities of the tokens of the
    rows ``logprob_rows`` (in that order), when some row asked for them."""

    tokens: torch.Tensor
    logprob_rows: list[int]
    logprobs: Optional[TokenLogprobs] = None


class StepSampler:
    def __init__(self, vocab_size: int, device: torch.device, eos_ids: Sequence[int],
                 fail: Callable[[Request, EngineError], None]) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.eos_ids = tuple(eos_ids)
        self.fail = fail  # ends one request with an error (the scheduler's `_fail`)
        self.history: Optional[TokenHistory] = None  # made for the first request with a penalty

    def sample(self, logits: StepLogits, reqs: list[Optional[Request]]) -> SampledStep:
        """The step's next tokens (a None row, a chunk that samples nothing, takes the greedy
        token) and the log-probabilities asked for; records the tokens in the token history."""
        for req in reqs:
            if req is not None and req.params.has_penalties and req.history_row is None:
                if self.history is None:
                    self.history = TokenHistory(self.vocab_size, self.device)
                req.history_row = self.history.add(req.prompt_ids)
        rows = list(reqs)
        tokens = self._sample_isolated(logits, rows)
        step = SampledStep(tokens, [i for i, r in enumerate(rows) if r is not None and r.params.logprobs is not None])
        if step.logprob_rows:
            try:
                top = max(rows[i].params.logprobs for i in step.logprob_rows)
                full = _gathered(logits)
                step.logprobs = token_logprobs(full[step.logprob_rows], tokens[step.logprob_rows], top)
            except Exception as exc:
                logger.exception("computing the log-probabilities of %d rows failed", len(step.logprob_rows))
                for i in step.logprob_rows:
                    self.fail(rows[i], EngineError(500, f"log-probabilities failed: {type(exc).__name__}: {exc}"))
                step.logprob_rows = []
        tracked = [i for i, r in enumerate(rows) if r is not None and r.history_row is not None]
        if tracked and self.history is not None:
            self.history.record([rows[i].history_row for i in tracked], tokens[tracked])
        return step

    def release(self, req: Request) -> None:
        """Free the request's token-history row (it has finished or failed)."""
        if req.history_row is not None and self.history is not None:
            self.history.remove(req.history_row)
        req.history_row = None

    def _sample_isolated(self, logits: StepLogits, rows: list[Optional[Request]]) -> torch.Tensor:
        """`_sample_rows`, failing alone the requests whose rows fail it (the module docstring);
        their entries in ``rows`` become None."""
        generators = [None if r is None else r.generator for r in rows]
        try:
            return self._sample_rows(logits, rows, generators)
        except Exception:
            logger.exception("sampling a batch of %d failed; finding the requests that fail it", len(rows))
        for i, req in enumerate(rows):
            if req is None or not req.params.needs_full_logits:
                continue
            try:
                self._sample_rows(_row(logits, i), [req], [_copy(req.generator)])
            except Exception as exc:
                self.fail(req, EngineError(500, f"sampling failed: {type(exc).__name__}: {exc}"))
                rows[i], generators[i] = None, None
        return self._sample_rows(logits, rows, generators)

    def _sample_rows(self, logits: StepLogits, rows: Sequence[Optional[Request]],
                     generators: Sequence[Optional[torch.Generator]]) -> torch.Tensor:
        params = [GREEDY if r is None else r.params for r in rows]
        processed = None
        if any(p.processes_logits for p in params):
            processed = _gathered(logits).clone()
            states = [RowState() if r is None else RowState(r.sampled, r.history_row) for r in rows]
            process_logits(processed, params, states, self.eos_ids, self.history)
        return sample(logits, params, generators, processed)


def host_logprobs(values: TokenLogprobs, token_ids: Sequence[int], top: Sequence[int]) -> list[TokenLogprob]:
    """Host `TokenLogprobs` of the tokens ``token_ids`` as `TokenLogprob`s, token i with its
    ``top[i]`` most likely alternatives."""
    chosen, ids, lps = values.logprobs.tolist(), values.top_ids.tolist(), values.top_logprobs.tolist()
    return [TokenLogprob(t, c, tuple(zip(i[:k], p[:k]))) for t, c, i, p, k in zip(token_ids, chosen, ids, lps, top)]


def _gathered(logits: StepLogits) -> torch.Tensor:
    if logits.full is None:
        raise ValueError("the step did not gather its logits (StepPlan.gather_logits)")
    return logits.full


def _row(logits: StepLogits, i: int) -> StepLogits:
    """Row ``i`` of a step's logits."""
    return StepLogits(logits.greedy_tokens[i:i + 1], None if logits.full is None else logits.full[i:i + 1])


def _copy(generator: Optional[torch.Generator]) -> Optional[torch.Generator]:
    """A generator in the same state (a trial draw leaves the original untouched)."""
    if generator is None:
        return None
    copy = torch.Generator(generator.device)
    copy.set_state(generator.get_state())
    return copy

"""`SamplingParams`: how one request decodes (validated; errors name the field).

Every integer fits in int64 and every float is finite, so the sampler can put any of them in a
tensor; the HTTP layer checks the same bounds first and answers 400.

Logits processing (vLLM's semantics, applied in this order to the model's fp32 logits before
temperature, top-k and top-p; `engine.runtime.logits_processors`): ``min_tokens`` bans the stop
tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) while fewer tokens have been generated;
``logit_bias`` adds its value to its token's logit; ``repetition_penalty`` divides the positive
and multiplies the negative logits of every token seen in the prompt or the output; then
``frequency_penalty`` times the token's count in the output and ``presence_penalty`` (once, if it
occurs there) are subtracted. Log-probabilities (``logprobs``, ``prompt_logprobs``) are those of
the model's distribution, before any of this (vLLM's default, "raw" log-probabilities).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional

from arfusion.engine.common.stop_strings import StopStrings

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GREEDY_TEMPERATURE = 1e-5  # temperatures up to this decode greedily (dividing by them overflows fp32)
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's chat limit; vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 100.0  # |bias| of one token, as OpenAI bounds it
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|, as OpenAI bounds them
MAX_STOP_TOKEN_IDS = 1024  # most stop_token_ids per request (a min_tokens ban covers each one, every step)
# Stop strings: OpenAI takes at most 4; these bound the automaton a request builds (`StopStrings`:
# linear in the total length, 64 KiB of characters at most) and the text a stream may hold back.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


def too_many_stop_strings(count: int) -> str:
    """The error naming ``stop`` for a list of ``count`` > MAX_STOP_STRINGS stop strings."""
    return f"stop: at most {MAX_STOP_STRINGS} stop strings, got {count}"


def stop_string_length_error(length: int) -> str:
    """The error naming ``stop`` for a stop string of ``length`` characters (0, or > MAX_STOP_STRING_CHARS)."""
    return f"stop: every stop string must have 1 to {MAX_STOP_STRING_CHARS} characters, got one of {length}"


def too_many_stop_token_ids(count: int) -> str:
    """The error naming ``stop_token_ids`` for ``count`` > MAX_STOP_TOKEN_IDS ids."""
    return f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {count}"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # 0: prefill the prompt (and score it, with prompt_logprobs), generate nothing
    temperature: float = 1.0  # <= GREEDY_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    seed: Optional[int] = None  # per-request generator; None: the engine's seeded default stream
    stop: tuple[str, ...] = ()  # stop strings: generation ends before the first match
    stop_token_ids: tuple[int, ...] = ()  # at most MAX_STOP_TOKEN_IDS, each >= 0
    ignore_eos: bool = False
    min_tokens: int = 0  # no stop token or stop string ends the output before this many tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), ids distinct
    logprobs: Optional[int] = None  # per output token: its log-probability and the n most likely
    prompt_logprobs: Optional[int] = None  # the same for every prompt token but the first
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.max_tokens <= INT64_MAX:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.top_k == -1 or 1 <= self.top_k <= INT64_MAX):
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed must fit in int64, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(too_many_stop_strings(len(self.stop)))
        bad = next((s for s in self.stop if not 0 < len(s) <= MAX_STOP_STRING_CHARS), None)
        if bad is not None:
            raise ValueError(stop_string_length_error(len(bad)))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(too_many_stop_token_ids(len(self.stop_token_ids)))
        if any(not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be token ids (>= 0)")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}")
        ids = [t for t, _ in self.logit_bias]
        if any(not 0 <= t <= INT64_MAX for t in ids) or len(set(ids)) != len(ids):
            raise ValueError("logit_bias token ids must be distinct and >= 0")
        if any(not (math.isfinite(b) and abs(b) <= MAX_LOGIT_BIAS) for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @cached_property
    def stop_strings(self) -> StopStrings:
        """The automaton that finds ``stop`` in the output (`StopStrings`), built at first use."""
        return StopStrings(self.stop)

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """``stop_token_ids`` as a set: a generated token is checked against it in O(1)."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Some penalty needs the request's token history (`TokenHistory`)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def processes_logits(self) -> bool:
        """Its logits are changed before sampling (penalties, bias, a min_tokens ban)."""
        return self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0

    @property
    def needs_full_logits(self) -> bool:
        """A step sampling it needs the whole vocabulary's fp32 logits on TP rank 0 (a gather at
        TP > 1): it samples with a temperature, processes its logits, or wants log-probabilities."""
        return not self.greedy or self.processes_logits or self.logprobs is not None

"""`SamplingParams`: how one request decodes (validated; errors name the field).

Every integer fits in int64 and every float is finite, so the sampler can put any of them in a
tensor; the HTTP layer checks the same bounds first and answers 400.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
GREEDY_TEMPERATURE = 1e-5  # temperatures up to this decode greedily (dividing by them overflows fp32)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # <= GREEDY_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1: all tokens
    seed: Optional[int] = None  # per-request generator; None: the engine's seeded default stream
    stop: tuple[str, ...] = ()  # stop strings: generation ends before the first match
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= INT64_MAX:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.top_k == -1 or 1 <= self.top_k <= INT64_MAX):
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise ValueError(f"seed must fit in int64, got {self.seed}")
        if any(not INT64_MIN <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must fit in int64")

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE or self.top_k == 1

"""The cached decision: how does this (layer, batch) run all-reduce + residual + RMSNorm?

`FusionDispatcher.strategy(layer_id, num_tokens)` picks a `fusion.strategy.Strategy` (``nccl``
is the unfused path) and `should_fuse_allreduce_residual_rmsnorm(layer_id, batch_size)` is
"anything but nccl". Both answer from inputs identical on every rank: the op's backends (whose
resources are voted into existence on every rank or on none), the model's shape, and a measured
table that is rank 0's, broadcast. So the answer is identical on every rank.

What can run a batch is asked of the backends themselves (``fits``), never copied: the op clears
the cache whenever a backend's resource changes. Among the available strategies a measured table
(`fusion.dispatch.table`) picks the fastest of the batch's bucket; without one, the built-in
rule (`fusion.dispatch.rule`). Answers sit in a bounded LRU (functools.lru_cache, a C
implementation) keyed on (layer_id, batch_size).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Optional, Protocol

import torch

from fusion.config import DEFAULT_CACHE_SIZE
from fusion.dispatch.rule import rule_choice
from fusion.dispatch.table import StrategyTable
from fusion.strategy import Strategy

_NCCL = Strategy.NCCL  # a module global: `is not` on it is the cheapest test on the hot path
NOT_SET_UP = "fusion is not set up"


class Fits(Protocol):
    """What the decision asks of a backend (`fusion.backends.base.Backend`)."""

    def fits(self, num_tokens: int) -> bool: ...


@dataclass(frozen=True)
class ModelShape:
    """The reductions' shape and the options that steer the rule."""

    world_size: int = 1
    hidden_size: int = 0
    dtype: torch.dtype = torch.bfloat16
    one_shot_max_input_bytes: Optional[int] = None


class FusionDispatcher:
    """Bounded-LRU cached fusion decision for one model (one hidden size and dtype)."""

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        """``cache_size``: the LRU's bound (`FusionConfig` checks it is at least 1)."""
        self.cache_size = cache_size
        self.shape = ModelShape()
        self.backends: Mapping[Strategy, Fits] = {}
        self.table: Optional[StrategyTable] = None
        self.off_reason: Optional[str] = NOT_SET_UP  # why no batch fuses (identical on every rank)
        self._cached = functools.lru_cache(maxsize=cache_size)(self._decide)
        self.strategy = self._cached  # (layer_id, num_tokens) -> Strategy, cached

    def update(self, shape: ModelShape, backends: Mapping[Strategy, Fits], table: Optional[StrategyTable],
               off_reason: Optional[str]) -> None:
        """Take new inputs (a backend's resource changed, a table arrived) and clear the cache."""
        self.shape, self.backends, self.table, self.off_reason = shape, backends, table, off_reason
        self.cache_clear()

    def should_fuse_allreduce_residual_rmsnorm(self, layer_id: int, batch_size: int) -> bool:
        """True when layer ``layer_id`` with ``batch_size`` tokens should defer its MLP
        all-reduce into the next norm (and fuse its attention all-reduce into its own)."""
        return self._cached(layer_id, batch_size) is not _NCCL

    def cache_info(self) -> functools._CacheInfo:
        """(hits, misses, maxsize, currsize), as functools.lru_cache reports them."""
        return self._cached.cache_info()

    def cache_clear(self) -> None:
        self._cached.cache_clear()

    def why_not(self, layer_id: int, batch_size: int) -> Optional[str]:
        """None when a fused strategy applies, else the reason it does not (uncached)."""
        return self._decide_with_reason(layer_id, batch_size)[1]

    def available(self, num_tokens: int) -> list[Strategy]:
        """The strategies whose backends can run ``num_tokens`` rows now."""
        return [s for s, backend in self.backends.items() if backend.fits(num_tokens)]

    def _decide(self, layer_id: int, batch_size: int) -> Strategy:
        return self._decide_with_reason(layer_id, batch_size)[0]

    def _decide_with_reason(self, layer_id: int, batch_size: int) -> tuple[Strategy, Optional[str]]:
        if layer_id < 0:
            raise ValueError(f"layer_id must be >= 0, got {layer_id}")
        if self.off_reason:
            return _NCCL, self.off_reason
        if batch_size <= 0:
            return _NCCL, "empty batch"
        available = self.available(batch_size)
        if _NCCL not in available or len(available) == 1:
            return _NCCL, f"no fused strategy can take {batch_size} tokens here (its buffers are smaller)"
        if Strategy.TORCH in available:
            return Strategy.TORCH, None
        if self.table is not None:
            best = self.table.fastest(batch_size, available)
            if best is not None:
                return best, (f"measured: nccl is fastest for {batch_size} tokens" if best is _NCCL else None)
        s = self.shape
        chosen = rule_choice(available, batch_size, s.hidden_size, s.dtype, s.world_size, s.one_shot_max_input_bytes)
        return chosen, (f"built-in rule: nccl is fastest for {batch_size} tokens" if chosen is _NCCL else None)

"""The dispatch plan: how does a (layer, batch) run all-reduce + residual add + RMSNorm?

`DispatchPlan.strategy(layer_id, num_tokens)` picks a `fusion.strategy.Strategy`; "fuse" is
anything but the declared fallback (`fusion.strategies.FALLBACK`, the unfused path). A plan is
immutable: it is built whole from the batch sizes the op's backends run (``rows``, a value each,
taken when the plan is built), the model's shape, the strategy table and the reason fusion is off,
and it never changes. The op replaces it on every event that changes any of those (a resource made, grown or
destroyed, a peer timeout: `fusion.backends.base.Backend.on_change`; a table arriving; set-up,
reconfigure, destroy), so a cached answer never outlives what it was decided from, and no one
refreshes anything by hand. Every input is identical on every rank (resources are voted into
existence on every rank or on none; the table is rank 0's, broadcast), so is every answer.

What can run a batch is read from those values on a miss. No strategy is named here: where no
fused strategy can take the batch, the fallback runs it; else a measured table
(`fusion.dispatch.table`) picks the fastest of the batch's bucket when it measured one of the
fused candidates there; else the built-in rule (`fusion.dispatch.rule`: costs, then the declared
fallback order). Answers sit in the plan's own bounded LRU (functools.lru_cache, a C
implementation; hits cost no Python call) keyed on (layer_id, batch_size): a new plan is a new
cache.

``layer_id`` is in the key because the mission's interface is per layer, not because it changes
an answer today: one op serves one hidden size and dtype, and every layer's reductions of that
shape have the same candidates, so a batch gets the same strategy in every layer. It would differ
in a mixed stack (dense and MoE layers with different reduction shapes or per-layer tables);
until then it only multiplies the entries (layers x batch sizes; `fusion.config.DEFAULT_CACHE_SIZE`).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from arfusion.fusion.backends.base import Rows
from arfusion.fusion.config import DEFAULT_CACHE_SIZE
from arfusion.fusion.dispatch.rule import rule_choice
from arfusion.fusion.dispatch.table import StrategyTable
from arfusion.fusion.strategies import FALLBACK
from arfusion.fusion.strategy import Strategy

NOT_SET_UP = "fusion is not set up"


class HasRows(Protocol):
    """What the decision asks of a backend (`fusion.backends.base.Backend`), once per plan."""

    def rows(self) -> Rows: ...


@dataclass(frozen=True)
class ModelShape:
    """The reductions' shape and the options that steer the rule."""

    world_size: int = 1
    hidden_size: int = 0
    dtype: torch.dtype = torch.bfloat16
    one_shot_max_input_bytes: int | None = None


class DispatchPlan:
    """The immutable fusion decision of one model (one hidden size and dtype) at one moment."""

    __slots__ = ("off_reason", "rows", "shape", "strategy", "table")

    def __init__(self, shape: ModelShape = ModelShape(), backends: Mapping[Strategy, HasRows] = {},
                 table: StrategyTable | None = None, off_reason: str | None = NOT_SET_UP,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        """``off_reason``: why no batch fuses (identical on every rank); ``cache_size``: the LRU's
        bound (`FusionConfig` checks it is at least 1)."""
        self.shape = shape
        self.rows = {s: backend.rows() for s, backend in backends.items()}  # values: what runs now
        self.table = table
        self.off_reason = off_reason
        # (layer_id, num_tokens) -> Strategy, cached: the hot path's one lookup
        self.strategy = functools.lru_cache(maxsize=cache_size)(self._decide)

    def should_fuse_allreduce_residual_rmsnorm(self, layer_id: int, batch_size: int) -> bool:
        """True when layer ``layer_id`` with ``batch_size`` tokens should defer its MLP
        all-reduce into the next norm (and fuse its attention all-reduce into its own)."""
        return self.strategy(layer_id, batch_size) is not FALLBACK

    def cache_info(self) -> functools._CacheInfo:
        """(hits, misses, maxsize, currsize), as functools.lru_cache reports them."""
        return self.strategy.cache_info()

    def why_not(self, layer_id: int, batch_size: int) -> str | None:
        """None when a fused strategy applies, else the reason it does not (uncached)."""
        return self._decide_with_reason(layer_id, batch_size)[1]

    def available(self, num_tokens: int) -> list[Strategy]:
        """The strategies whose backends could run ``num_tokens`` rows when the plan was built."""
        return [s for s, rows in self.rows.items() if rows.holds(num_tokens)]

    def _decide(self, layer_id: int, batch_size: int) -> Strategy:
        return self._decide_with_reason(layer_id, batch_size)[0]

    def _decide_with_reason(self, layer_id: int, batch_size: int) -> tuple[Strategy, str | None]:
        if layer_id < 0:
            raise ValueError(f"layer_id must be >= 0, got {layer_id}")
        if self.off_reason:
            return FALLBACK, self.off_reason
        if batch_size <= 0:
            return FALLBACK, "empty batch"
        available = self.available(batch_size)
        fused = [s for s in available if s is not FALLBACK]
        if FALLBACK not in available or not fused:
            return FALLBACK, f"no fused strategy can take {batch_size} tokens here (its buffers are smaller)"
        if self.table is not None and self.table.fastest(batch_size, fused) is not None:
            best = self.table.fastest(batch_size, available)
            return best, (f"measured: {FALLBACK} is fastest for {batch_size} tokens" if best is FALLBACK else None)
        s = self.shape
        chosen = rule_choice(available, batch_size, s.hidden_size, s.dtype, s.world_size, s.one_shot_max_input_bytes)
        return chosen, (f"built-in rule: {FALLBACK} is fastest for {batch_size} tokens" if chosen is FALLBACK
                        else None)

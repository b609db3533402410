"""`AllReduceFusion`: the fused all-reduce + residual add + RMSNorm of one model on one TP group:
its config, one backend per strategy (`fusion.backends`) and the cached dispatch decision.

An engine builds one per model before it builds the model (no collective yet), calls `setup()`
(collective) and `reserve()` before CUDA-graph capture, and hands the op to every layer. A
layer wraps each row-parallel output in a `PartialSum` (layer id, this op); the norm that takes
it (`layers.layernorm.RMSNorm`) makes the one call of a reduction point:

    reduce_add_rms_norm(partial, residual, w, eps)  (rms_norm(sum(x) + residual), sum(x) + residual)
                                                    by the strategy the plan gives (layer_id, tokens);
                                                    at TP size 1 outside deterministic mode a sum not
                                                    yet formed (`fusion.UnformedSum`) forms itself in
                                                    the norm's launch

so every reduction runs exactly once, by a strategy whose backend fits the batch (the unfused
fallback, reduce then norm, is one of them). The op keeps no state between layers; it counts the reductions it
runs, by strategy (``counts``). ``run`` reduces by an explicit strategy (tuner, benchmarks).

The decision is ``plan`` (`fusion.dispatch.decision.DispatchPlan`), immutable; the op replaces
it on every event that changes its inputs: a backend's ``on_change`` (a resource made, grown or
destroyed, a peer timeout), a table arriving, set-up, reconfigure and destroy. ``strategy`` is
the current plan's cached lookup itself (a hit is a C call).

Inputs are checked where they enter (`fusion.validation`): in `reduce_add_rms_norm` fully
unless `CheckedInputs` trusts them (the residual the op returned last, a weight it checked:
one full check per forward), in `run` always.

Deterministic mode (``FusionConfig(deterministic=True)``) keeps fusion on: the op builds only the
strategies `fusion.backends.deterministic` allows, each following the canonical recipe of
`fusion.reference` (rank-order fp32 sum, one rounding; the residual added at one point; the
row's sum of squares by a tree fixed by the hidden size), NCCL's included. So the dispatch may
still switch strategies by batch size: a row's bits never depend on the other rows of the call.
flashinfer's kernels are left out (`status` says so); which backend is primary (bounds the
fusion limit), which are made on demand in each mode and which call for start-up tuning, the
backend classes declare (`fusion.backends.base.Backend`, registered in `fusion.strategies`).
"""
from __future__ import annotations

import collections
import logging
from typing import Any

import torch
from arfusion.fusion.backends.base import Backend, Made
from arfusion.fusion.config import NO_TABLE, FusionConfig
from arfusion.fusion.dispatch.cost_model import rule_picks
from arfusion.fusion.dispatch.decision import NOT_SET_UP, DispatchPlan, ModelShape
from arfusion.fusion.dispatch.table import (
    PACKAGED_TABLE,
    StrategyTable,
    dtype_name,
    gpu_name,
    read_table,
    select_table,
)
from arfusion.fusion.errors import FusionInputError
from arfusion.fusion.group import TensorParallelGroup
from arfusion.fusion.partial_sum import PartialSum, UnformedSum
from arfusion.fusion.strategies import (
    BACKENDS,
    FALLBACK,
    build_backends,
    deterministic_exclusions,
    with_role,
)
from arfusion.fusion.strategy import FusedOutput, Quant, Strategy
from arfusion.fusion.tuning.startup import tune_at_startup
from arfusion.fusion.validation import CheckedInputs, check_fusion_inputs

logger = logging.getLogger(__name__)
DESTROYED = "the fusion op's buffers were destroyed"


class AllReduceFusion:
    """All-reduce + residual add + RMSNorm for one model (hidden size, dtype) on one TP group."""

    def __init__(self, group: TensorParallelGroup, config: FusionConfig, hidden_size: int,
                 dtype: torch.dtype) -> None:
        self.group = group
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.counts: collections.Counter[Strategy] = collections.Counter()  # reductions run, by strategy
        self._inputs = CheckedInputs()  # the full input check once per forward, not per reduction point
        self._take_config(config)

    def _take_config(self, config: FusionConfig) -> None:
        self.config = config
        self.table: StrategyTable | None = None
        self._off_reason: str | None = NOT_SET_UP
        self.backends: dict[Strategy, Backend] = build_backends(self.group, config)
        self._primary = self.backends[with_role(self.backends, Made.PRIMARY, config.deterministic)[0]]
        self._on_demand = with_role(self.backends, Made.ON_DEMAND, config.deterministic)
        self._tuned = any(BACKENDS[s].tuned_at_startup for s in self.backends)
        for backend in self.backends.values():
            backend.on_change = self._replan
        self._replan()

    def _replan(self) -> None:
        """A new plan from the current backends, table and off reason (an event changed one)."""
        shape = ModelShape(self.group.world_size, self.hidden_size, self.dtype, self.config.one_shot_max_input_bytes)
        self.plan = DispatchPlan(shape, self.backends, self.table, self._off_reason, self.config.cache_size)
        # (layer_id, num_tokens) -> the `Strategy` of that layer's reductions: the plan's cached lookup
        self.strategy = self.plan.strategy

    def _set(self, off_reason: str | None, table: StrategyTable | None = None) -> None:
        self._off_reason, self.table = off_reason, table
        self._replan()

    # ---- life cycle (collectives: every rank calls them together, outside CUDA-graph capture)

    def setup(self) -> None:
        """Agree on whether fusion can run; create the primary backend's resource (the flashinfer
        workspace, our fused two-shot's buffer in deterministic mode, or the torch backend's
        limit), then read the strategy table (measured now where a backend declares
        ``tuned_at_startup`` and no table holds the configuration) and make the resources of the
        on-demand strategies it (or the built-in rule) picks. Logs once (rank 0) why fusion stays
        off when it was asked for."""
        reason, table = self._static_off_reason(), None
        if reason is None:
            primary = self._primary
            if not primary.ensure(self._rows(primary.strategy), self.hidden_size, self.dtype):
                reason = f"{primary.strategy} unavailable ({primary.failure})"
            else:
                table = self._strategy_table()
                self._ensure_picked(table)
        self._set(reason, table)
        if self.config.enabled and reason and self.group.rank == 0:
            logger.warning("all-reduce fusion was requested but runs unfused: %s", reason)

    def reconfigure(self, config: FusionConfig) -> None:
        """Free the buffers, take ``config`` and `setup` again (e.g. off -> on in one benchmark
        run). Graphs captured before baked the old decisions in: recapture them."""
        self.destroy()
        self._take_config(config)
        self.setup()

    def reserve(self, max_tokens: int) -> bool:
        """Grow the primary backend (and so the fusion limit) to ``max_tokens``; call before
        CUDA-graph capture. Returns whether a fused strategy can take that many tokens."""
        if self._off_reason is not None:
            return False
        primary = self._primary
        if not primary.ensure(max_tokens, self.hidden_size, self.dtype) and self.group.rank == 0:
            logger.warning("all-reduce fusion: %s could not grow to %d tokens (%s)", primary.strategy, max_tokens,
                           primary.failure)
        return any(b.fits(max_tokens) for s, b in self.backends.items() if s is not FALLBACK)

    def ensure_all(self, max_tokens: int) -> None:
        """Collective: every backend's resource for ``max_tokens`` rows (each voted: ready on every
        rank or on none), for measuring and benchmarking every strategy."""
        for strategy, backend in self.backends.items():
            backend.ensure(self._rows(strategy, max_tokens), self.hidden_size, self.dtype)

    def destroy(self) -> None:
        """Free every backend's resource (on every rank, before the process groups)."""
        for backend in self.backends.values():
            backend.destroy()
        self._inputs.forget()
        self._set(DESTROYED)

    def raise_if_failed(self) -> None:
        """`fusion.errors.FusionTimeoutError` when a backend's kernel gave up waiting for a peer
        (a stalled or dead rank): its outputs since then are garbage, and the plan no longer
        offers it (its ``on_change``). Cheap (a host read, no sync): call it where the step's
        results reach the host, before they are used."""
        for backend in self.backends.values():
            backend.raise_if_failed()

    # ---- the cached decision

    def should_fuse_allreduce_residual_rmsnorm(self, layer_id: int, batch_size: int) -> bool:
        """Does layer ``layer_id`` with ``batch_size`` tokens fuse its reductions (and defer its
        MLP all-reduce into the next norm)? Cached in the plan; identical on every rank."""
        return self.strategy(layer_id, batch_size) is not FALLBACK

    def cache_info(self) -> Any:
        return self.plan.cache_info()

    def cache_clear(self) -> None:
        self.strategy.cache_clear()

    @property
    def active(self) -> bool:
        """True when some batch size can take a fused strategy."""
        return self._off_reason is None

    # ---- the hot path

    def reduce_add_rms_norm(self, partial: PartialSum, residual: torch.Tensor | None, weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(s + residual), s + residual)``, ``s`` the sum over the group of
        ``partial``'s tensor (taken: a second call raises), by the strategy of
        ``(partial.layer_id, tokens)``; with ``residual`` None the sum is ``s``. The tensor and
        ``residual`` are consumed (a backend may overwrite both). An `UnformedSum` forms itself in
        the norm's launch where `_norm_unformed` allows, else is materialized first."""
        x, partial.pending = partial.pending, None
        if x is None:
            raise partial.taken_twice()
        inputs = self._inputs  # trusted residual and weight: the cheap test (`CheckedInputs`)
        if isinstance(x, UnformedSum):
            out = self._norm_unformed(partial.layer_id, x, residual, weight, eps)
            if out is not None:
                return out
            x = x.materialize()
        if not (residual is not None and residual is inputs.residual and x.shape == residual.shape
                and x.dtype is residual.dtype and x.is_contiguous() and inputs.weights.get(id(weight)) is weight):
            inputs.check(x, residual, weight)
        strategy = self.strategy(partial.layer_id, x.shape[0])
        self.counts[strategy] += 1
        normed, residual_out = self.backends[strategy].run(x, residual, weight, eps, None)[:2]
        inputs.residual = residual_out  # the next reduction's trusted residual
        return normed, residual_out

    def _norm_unformed(self, layer_id: int, x: UnformedSum, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``x.add_rms_norm(residual, weight, eps)``, counted as the reduction of the layer's
        strategy (at world size 1 it reduces nothing), where it applies: world size 1, not
        deterministic, ``residual`` and ``weight`` the trusted ones and ``x`` of the residual's
        shape and dtype (`CheckedInputs`), and the launch takes them; else None, nothing run."""
        inputs = self._inputs
        if (self.group.world_size != 1 or self.config.deterministic or residual is None
                or residual is not inputs.residual or x.shape != residual.shape or x.dtype is not residual.dtype
                or inputs.weights.get(id(weight)) is not weight):
            return None
        out = x.add_rms_norm(residual, weight, eps)
        if out is None:
            return None
        self.counts[self.strategy(layer_id, x.shape[0])] += 1
        inputs.residual = out[1]
        return out

    def take_single_rank(self, partial: PartialSum, residual: torch.Tensor,
                         residual_out: torch.Tensor) -> torch.Tensor | None:
        """At world size 1 outside deterministic mode, where the sum over the group is
        ``partial``'s own tensor and the plan's strategy (the fallback: reduce, here nothing,
        then add + RMSNorm) would only normalise: that tensor, taken (a second reduction raises)
        and counted as that strategy's reduction, for a caller that adds ``residual`` and
        normalises in a launch of its own, writing the sum into ``residual_out`` (a new tensor
        like ``residual``); an `UnformedSum` is materialized. ``residual_out`` is then the next reduction's trusted residual if
        ``residual`` was (`CheckedInputs`). None, taking nothing, elsewhere."""
        if self.group.world_size != 1 or self.config.deterministic:
            return None
        x, partial.pending = partial.formed(), None
        if x is None:
            raise partial.taken_twice()
        self.counts[self.strategy(partial.layer_id, x.shape[0])] += 1
        if residual is self._inputs.residual:
            self._inputs.residual = residual_out
        return x

    def run(self, strategy: Strategy, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, quant: Quant | None = None) -> FusedOutput:
        """One reduction by an explicit ``strategy`` (tuner, benchmarks): `FusionInputError` when
        this op has no ready backend for it that fits ``x``."""
        check_fusion_inputs(x, residual, weight)
        strategy = Strategy(strategy)
        backend = self.backends.get(strategy)
        if backend is None or not backend.fits(x.shape[0]):
            raise FusionInputError(f"{strategy} cannot run {x.shape[0]} tokens here: "
                                   + ("the fusion backend option has no such strategy" if backend is None
                                      else backend.failure or "its buffers do not exist or are too small"))
        self.counts[strategy] += 1
        return backend.run(x, residual, weight, eps, quant)

    # ---- set-up helpers

    def _static_off_reason(self) -> str | None:
        """Why fusion never runs with this config on this group (rank-independent)."""
        if not self.config.enabled:
            return "fusion is not enabled (--enable-flashinfer-allreduce-fusion)"
        if self.group.world_size == 1:
            return "TP size is 1: there is nothing to all-reduce"
        return None

    def _rows(self, strategy: Strategy, largest: int | None = None) -> int:
        """The rows ``strategy``'s resource is made for (its backend class says)."""
        return BACKENDS[strategy].rows_to_make(self.config, largest)

    def _strategy_table(self) -> StrategyTable | None:
        """Collective: the strategy table every rank uses (rank 0's, broadcast: packaged or
        ``table_path``; else measured now when the config's ``tune_at_startup`` is on and some
        backend of the op declares ``tuned_at_startup``; else none, and the built-in rule decides)."""
        if (self.config.table_path or "").lower() == NO_TABLE:  # the same config on every rank
            return None
        table = self.group.broadcast_object(self._read_table() if self.group.rank == 0 else None)
        if table is None and self.config.table_path is None and self.config.tune_at_startup and self._tuned:
            largest = self._largest_batch()
            on_demand = [(self.backends[s], self._rows(s, largest)) for s in self._on_demand]
            table = tune_at_startup(self.group, self.backends, on_demand, self.hidden_size, self.dtype, largest,
                                    self.config.tuning_cache_dir, self.config.tuning_budget_s)
        return table

    def _largest_batch(self) -> int:
        return max(self.config.max_tokens, self.config.symm_max_tokens or 0)

    def _ensure_picked(self, table: StrategyTable | None) -> None:
        """Collective: the resources of the on-demand strategies the table (or the rule, among
        this op's strategies) picks anywhere."""
        if table is not None:
            picked = {min(row, key=row.__getitem__) for row in table.timings_us}
        else:
            picked = rule_picks(self._largest_batch(), self.hidden_size, self.dtype, self.group.world_size,
                                self.backends)
        for strategy in self._on_demand:
            if strategy in picked:
                self.backends[strategy].ensure(self._rows(strategy), self.hidden_size, self.dtype)

    def _read_table(self) -> StrategyTable | None:
        """(rank 0) The configured table's entry for this GPU, TP size, hidden and dtype."""
        gpu = gpu_name(self.group.device)
        path = self.config.table_path or PACKAGED_TABLE
        entries = read_table(path)
        table = select_table(entries, gpu, self.group.world_size, self.hidden_size, dtype_name(self.dtype))
        if entries is not None and table is None and self.config.table_path:
            logger.warning("strategy table %s has no entry for %s, TP%d, hidden %d, %s: using the built-in rule",
                           path, gpu, self.group.world_size, self.hidden_size, self.dtype)
        return table

    def status(self) -> dict[str, Any]:
        """What /get_server_info shows: whether the fused path is active and why not; in
        deterministic mode the strategies it allows and why the others are left out."""
        info = self.plan.cache_info()
        deterministic = self.config.deterministic
        return {
            "requested": self.config.enabled,
            "active": self.active,
            "backend": self.config.backend,
            "reason_inactive": self._off_reason,
            "max_tokens": self._primary.capacity,
            "measured_strategy_table": self.table is not None,
            "backend_tokens": {s.value: b.capacity for s, b in self.backends.items() if s is not FALLBACK},
            "cache": {"hits": info.hits, "misses": info.misses, "maxsize": info.maxsize, "currsize": info.currsize},
            "reductions": {s.value: n for s, n in sorted(self.counts.items())},
            "deterministic": deterministic,
            # the strategies the dispatch may pick, each following the canonical recipe
            # (fusion.reference); empty when deterministic mode is off (no such guarantee)
            "deterministic_strategies": [s.value for s in self.backends] if deterministic else [],
            "deterministic_excluded": ({s.value: why for s, why in deterministic_exclusions(
                self.group.world_size).items()} if deterministic else {}),
        }

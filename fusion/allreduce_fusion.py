"""`AllReduceFusion`: the fused all-reduce + residual add + RMSNorm of one model on one TP group:
its config, one backend per strategy (`fusion.backends`) and the cached dispatch decision.

An engine builds one per model before it builds the model (no collective yet), calls `setup()`
(collective) and `reserve()` before CUDA-graph capture, and hands the op to every layer's
`LayerCommunicator`. At each reduction point the communicator makes one call:

    all_reduce_add_rms_norm(x, residual, w, eps, layer_id)  x partial: reduce + add + norm by
                                                            layer_id's cached strategy (prepare_mlp)
    should_fuse_allreduce_residual_rmsnorm(layer_id, n)     does layer_id defer its MLP reduction?
      -> partial_sum(x, layer_id)                           yes: x handed on as a `PartialSum`
      -> all_reduce(x)                                      no: reduced now (NCCL, in place)
    add_rms_norm(h, residual, w, eps)                       the next norm: a `PartialSum` is reduced
                                                            into it (fused), a tensor is added + normed

so every reduction runs exactly once, by a strategy whose backend fits the batch. The op keeps
no state between layers; it counts the reductions it runs, by strategy (``counts``).

Deterministic mode (``FusionConfig(deterministic=True)``) keeps fusion on: the op builds only the
strategies `fusion.backends.deterministic` allows, each following the canonical recipe of
`fusion.reference` (rank-order fp32 sum, one rounding; the residual added at one point; the
row's sum of squares by a tree fixed by the hidden size), and its unfused calls (``all_reduce``,
``add_rms_norm`` of a reduced tensor) follow it too. So the dispatch may still switch strategies
by batch size: a row's bits never depend on the other rows of the call. flashinfer's kernels are
left out (`status` says so); the primary backend, which bounds the fusion limit, is then our
fused two-shot (``symm_mem_fused``).
"""
from __future__ import annotations

import collections
import logging
from typing import Any, Optional, Union

import torch

from fusion import norm
from fusion.backends import deterministic
from fusion.backends import ON_DEMAND, Backend, build_backends
from fusion.config import NO_TABLE, FusionConfig
from fusion.dispatch.cost_model import rule_picks
from fusion.dispatch.decision import FusionDispatcher, ModelShape
from fusion.dispatch.table import PACKAGED_TABLE, StrategyTable, dtype_name, gpu_name, read_table, select_table
from fusion.errors import FusionInputError
from fusion.group import TensorParallelGroup
from fusion.partial_sum import PartialSum
from fusion.strategy import FusedOutput, Quant, Strategy
from fusion.tuning.startup import tune_at_startup
from fusion.validation import check_fusion_inputs

logger = logging.getLogger(__name__)
_NCCL = Strategy.NCCL
DESTROYED = "the fusion op's buffers were destroyed"


class AllReduceFusion:
    """All-reduce + residual add + RMSNorm for one model (hidden size, dtype) on one TP group."""

    def __init__(self, group: TensorParallelGroup, config: FusionConfig, hidden_size: int,
                 dtype: torch.dtype) -> None:
        self.group = group
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.counts: collections.Counter[Strategy] = collections.Counter()  # reductions run, by strategy
        self.table: Optional[StrategyTable] = None
        self._take_config(config)

    def _take_config(self, config: FusionConfig) -> None:
        self.config = config
        self.backends: dict[Strategy, Backend] = build_backends(self.group, config.backend, config.launch_with_pdl,
                                                                config.deterministic)
        self.dispatcher = FusionDispatcher(config.cache_size)
        self._strategy = self.dispatcher.strategy  # the cached (layer_id, tokens) -> Strategy

    # ---- life cycle (collectives: every rank calls them together, outside CUDA-graph capture)

    def setup(self) -> None:
        """Agree on whether fusion can run; create the primary backends' resources (the flashinfer
        workspace, or the torch backend's limit), then the strategy table and the symmetric
        buffers of the strategies it (or the built-in rule) picks. Logs once (rank 0) why fusion
        stays off when it was asked for."""
        reason = self._static_off_reason()
        if reason is None:
            primary = self._primary()
            if not primary.ensure(self.config.max_tokens, self.hidden_size, self.dtype):
                reason = f"{primary.strategy} unavailable ({primary.failure})"
            elif self.config.backend == "flashinfer":
                self.table = self._strategy_table()
                self._ensure_picked()
        self._refresh(reason)
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
        if self.dispatcher.off_reason is not None:
            return False
        primary = self._primary()
        if not primary.ensure(max_tokens, self.hidden_size, self.dtype) and self.group.rank == 0:
            logger.warning("all-reduce fusion: %s could not grow to %d tokens (%s)", primary.strategy, max_tokens,
                           primary.failure)
        self._refresh(None)
        return any(b.fits(max_tokens) for s, b in self.backends.items() if s is not _NCCL)

    def ensure_all(self, max_tokens: int) -> None:
        """Collective: every backend's resource for ``max_tokens`` rows (each voted: ready on every
        rank or on none), for measuring and benchmarking every strategy."""
        for backend in self.backends.values():
            backend.ensure(backend.rows_for(max_tokens), self.hidden_size, self.dtype)
        self._refresh(self.dispatcher.off_reason)

    def destroy(self) -> None:
        """Free every backend's resource (on every rank, before the process groups)."""
        for backend in self.backends.values():
            backend.destroy()
        self.table = None
        self._refresh(DESTROYED)

    def raise_if_failed(self) -> None:
        """`fusion.errors.FusionTimeoutError` when a backend's kernel gave up waiting for a peer
        (a stalled or dead rank): its outputs since then are garbage. Cheap (a host read, no
        sync): call it where the step's results reach the host, before they are used."""
        for backend in self.backends.values():
            backend.raise_if_failed()

    # ---- the cached decision

    def should_fuse_allreduce_residual_rmsnorm(self, layer_id: int, batch_size: int) -> bool:
        """Does layer ``layer_id`` with ``batch_size`` tokens fuse its reductions (and defer its
        MLP all-reduce into the next norm)? Cached; identical on every rank."""
        return self._strategy(layer_id, batch_size) is not _NCCL

    def strategy(self, layer_id: int, num_tokens: int) -> Strategy:
        """The `Strategy` of layer ``layer_id``'s reductions at ``num_tokens`` tokens, cached."""
        return self._strategy(layer_id, num_tokens)

    def cache_info(self) -> Any:
        return self.dispatcher.cache_info()

    def cache_clear(self) -> None:
        self.dispatcher.cache_clear()

    @property
    def active(self) -> bool:
        """True when some batch size can take a fused strategy."""
        return self.dispatcher.off_reason is None

    # ---- the hot path

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                                eps: float, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(sum(x) + residual), sum(x) + residual)`` by layer ``layer_id``'s strategy;
        ``x`` (this rank's partial sum) and ``residual`` are consumed."""
        check_fusion_inputs(x, residual, weight)
        out = self._run(self._strategy(layer_id, x.shape[0]), x, residual, weight, eps, None)
        return out.normed, out.residual

    def partial_sum(self, x: torch.Tensor, layer_id: int) -> PartialSum:
        """Layer ``layer_id``'s MLP output, un-reduced, for the next `add_rms_norm` to reduce by
        the layer's strategy."""
        return PartialSum(x, layer_id, self._strategy(layer_id, x.shape[0]))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group now, in place (NCCL; deterministic mode: the canonical
        rank-order sum, `fusion.backends.deterministic.ordered_all_reduce`); returns ``x``."""
        self.counts[_NCCL] += 1
        if self.config.deterministic:
            return deterministic.ordered_all_reduce(self.group, x)
        return self.group.all_reduce(x)

    def add_rms_norm(self, x: Union[torch.Tensor, PartialSum], residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(s + residual), s + residual)``: ``s`` is a `PartialSum` reduced here by
        its strategy (fused into this norm), or an already reduced tensor. Inputs consumed (see
        `fusion.norm.add_rms_norm` and the backends)."""
        if isinstance(x, PartialSum):
            strategy, partial = x.strategy, x.take()
            check_fusion_inputs(partial, residual, weight)
            out = self._run(strategy, partial, residual, weight, eps, None)
            return out.normed, out.residual
        check_fusion_inputs(x, residual, weight)
        if self.config.deterministic:
            return deterministic.add_rms_norm(x, residual, weight, eps)
        return norm.add_rms_norm(x, residual, weight, eps)

    def run(self, strategy: Strategy, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
            eps: float, quant: Optional[Quant] = None) -> FusedOutput:
        """One reduction by an explicit ``strategy`` (tuner, benchmarks): `FusionInputError` when
        this op has no ready backend for it that fits ``x``."""
        check_fusion_inputs(x, residual, weight)
        strategy = Strategy(strategy)
        backend = self.backends.get(strategy)
        if backend is None or not backend.fits(x.shape[0]):
            raise FusionInputError(f"{strategy} cannot run {x.shape[0]} tokens here: "
                                   + ("the fusion backend option has no such strategy" if backend is None
                                      else backend.failure or "its buffers do not exist or are too small"))
        return self._run(strategy, x, residual, weight, eps, quant)

    def _run(self, strategy: Strategy, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
             eps: float, quant: Optional[Quant]) -> FusedOutput:
        self.counts[strategy] += 1
        return self.backends[strategy].run(x, residual, weight, eps, quant)

    # ---- set-up helpers

    def _static_off_reason(self) -> Optional[str]:
        """Why fusion never runs with this config on this group (rank-independent)."""
        if not self.config.enabled:
            return "fusion is not enabled (--enable-flashinfer-allreduce-fusion)"
        if self.group.world_size == 1:
            return "TP size is 1: there is nothing to all-reduce"
        return None

    def _primary(self) -> Backend:
        """The backend that bounds the fusion limit: flashinfer's workspace (shared by one-shot
        and two-shot), our fused two-shot in deterministic mode, or the torch backend."""
        if self.config.backend == "torch":
            return self.backends[Strategy.TORCH]
        return self.backends[Strategy.SYMM_MEM_FUSED if self.config.deterministic else Strategy.FLASHINFER_ONE_SHOT]

    def _refresh(self, off_reason: Optional[str]) -> None:
        """Hand the dispatcher the current inputs (the backends themselves answer what fits) and clear its cache."""
        shape = ModelShape(self.group.world_size, self.hidden_size, self.dtype, self.config.one_shot_max_input_bytes)
        self.dispatcher.update(shape, self.backends, self.table, off_reason)

    def _strategy_table(self) -> Optional[StrategyTable]:
        """Collective: the strategy table every rank uses (rank 0's, broadcast: packaged or
        ``table_path``; else measured now when ``tune_at_startup``; else none, and the built-in
        rule decides)."""
        if (self.config.table_path or "").lower() == NO_TABLE:  # the same config on every rank
            return None
        table = self.group.broadcast_object(self._read_table() if self.group.rank == 0 else None)
        if table is None and self.config.table_path is None and self.config.tune_at_startup:
            on_demand = [self.backends[s] for s in ON_DEMAND if s in self.backends]
            table = tune_at_startup(self.group, self.backends, on_demand, self.hidden_size, self.dtype,
                                    self._largest_batch(), self.config.tuning_cache_dir, self.config.tuning_budget_s)
        return table

    def _largest_batch(self) -> int:
        return max(self.config.max_tokens, self.config.symm_max_tokens or 0)

    def _ensure_picked(self) -> None:
        """Collective: the symmetric buffers of the strategies the table (or the rule) picks anywhere."""
        if self.table is not None:
            picked = {min(row, key=row.__getitem__) for row in self.table.timings_us}
        else:
            picked = rule_picks(self._largest_batch(), self.hidden_size, self.dtype, self.group.world_size,
                                self.backends)
        for strategy in ON_DEMAND:
            if strategy in picked and strategy in self.backends:
                backend = self.backends[strategy]
                rows = self.config.symm_max_tokens if strategy is Strategy.SYMM_MEM_FUSED else None
                backend.ensure(backend.rows_for(rows or self.config.max_tokens), self.hidden_size, self.dtype)

    def _read_table(self) -> Optional[StrategyTable]:
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
        info = self.dispatcher.cache_info()
        return {
            "requested": self.config.enabled,
            "active": self.active,
            "backend": self.config.backend,
            "reason_inactive": self.dispatcher.off_reason,
            "max_tokens": self._primary().capacity,
            "measured_strategy_table": self.table is not None,
            "backend_tokens": {s.value: b.capacity for s, b in self.backends.items() if s is not _NCCL},
            "cache": {"hits": info.hits, "misses": info.misses, "maxsize": info.maxsize, "currsize": info.currsize},
            "reductions": {s.value: n for s, n in sorted(self.counts.items())},
            "deterministic": self.config.deterministic,
            # the strategies the dispatch may pick, each following the canonical recipe
            # (fusion.reference); empty when deterministic mode is off (no such guarantee)
            "deterministic_strategies": [s.value for s in self.backends] if self.config.deterministic else [],
            "deterministic_excluded": ({s.value: why for s, why in deterministic.excluded(self.group.world_size).items()}
                                       if self.config.deterministic else {}),
        }

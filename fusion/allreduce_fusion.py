"""`AllReduceFusion`: the fused all-reduce + residual add + RMSNorm of one model on one TP group:
its config, flashinfer workspace, symmetric buffers and cached dispatch decision.

An engine builds one per model before it builds the model (no collective yet), calls `setup()`
(collective) and `reserve()` before CUDA-graph capture, and hands the op to every layer's
`LayerCommunicator`. At each reduction point the communicator makes one call that decides
(cached on (layer_id, num_tokens)) and runs:

    all_reduce_add_rms_norm(x, residual, w, eps, layer_id)  x partial: reduce + add + norm by
                                                            layer_id's strategy (prepare_mlp)
    defer_all_reduce(x, layer_id)                           decide once: fused -> the reduction
                                                            is owed and x is handed on
                                                            un-reduced; nccl -> reduced now
    add_rms_norm(x, residual, w, eps, layer_id)             the owed reduction of layer_id fused
                                                            into this norm, or a plain add + norm
                                                            when nothing is owed

so every reduction runs exactly once, and an owed reduction that the next norm does not take
raises instead of leaving partial sums in the residual stream. A strategy whose buffers cannot
hold the input runs as ``nccl``.
"""
from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from fusion import norm
from fusion.config import NO_TABLE, FusionConfig
from fusion.dispatch.cost_model import rule_picks
from fusion.dispatch.decision import FusionDispatcher, FusionEnvironment
from fusion.group import TensorParallelGroup
from fusion.platform import device_capability, flashinfer_import_error
from fusion.strategies import RUNNERS, FusedOutput, Quant, Resources, Strategy
from fusion.backends.symm_mem import SymmMemAllReduce
from fusion.backends.symm_mem_fused import SymmMemFusedAllReduceNorm
from fusion.tuning.startup import tune_at_startup
from fusion.dispatch.table import PACKAGED_TABLE, StrategyTable, dtype_name, gpu_name, read_table, select_table
from fusion.validation import check_fusion_inputs
from fusion.backends.flashinfer_workspace import AllReduceFusionWorkspace, WorkspaceFactory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwedReduction:
    """A layer's MLP all-reduce, deferred into the next norm."""

    layer_id: int
    num_tokens: int
    strategy: Strategy


class AllReduceFusion:
    """All-reduce + residual add + RMSNorm for one model (hidden size, dtype) on one TP group."""

    def __init__(self, group: TensorParallelGroup, config: FusionConfig, hidden_size: int, dtype: torch.dtype,
                 workspace_factory: Optional[WorkspaceFactory] = None) -> None:
        self.group = group
        self.config = config
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.workspace = AllReduceFusionWorkspace(group, workspace_factory)
        self.symm_mem = SymmMemAllReduce(group)
        self.symm_fused = SymmMemFusedAllReduceNorm(group)
        self.dispatcher = FusionDispatcher(config.cache_size, self._environment(workspace_ready=False))
        self.counts: collections.Counter[Strategy] = collections.Counter()  # reductions run, by strategy
        self._owed: Optional[OwedReduction] = None
        self._resources = Resources(group, None, self.symm_mem, self.symm_fused, config.launch_with_pdl)

    # ---- life cycle (collectives: every rank calls them together, outside CUDA-graph capture)

    def setup(self) -> None:
        """Agree on whether fusion can run; create the workspace and the buffers the measured
        table picks. Logs once (rank 0) why fusion stays off when it was asked for."""
        env = self._environment(workspace_ready=True)  # everything but the workspace
        reasons = self.group.all_gather_object(env.static_reason())
        reason = next((r for r in reasons if r), None)  # identical on every rank
        uses_workspace = self.config.backend == "flashinfer"
        if reason is None and uses_workspace:
            if not self.workspace.ensure(self.config.max_tokens, self.hidden_size, self.dtype):
                reason = f"workspace creation failed ({self.workspace.failure})"
            self._resources = replace(self._resources, workspace=self.workspace.handle)  # start-up tuning runs it
        if reason:
            env = replace(env, enabled=False, disabled_reason=reason)
        elif uses_workspace:
            env = self._with_table(env)
            self.counts.clear()  # start-up tuning's measurements are no reductions of the model
        self._update(env)
        if self.config.enabled and reason and self.group.rank == 0:
            logger.warning("all-reduce fusion was requested but runs unfused: %s", reason)

    def reconfigure(self, config: FusionConfig) -> None:
        """Free the buffers, take ``config`` and `setup` again (e.g. off -> on in one benchmark
        run). Graphs captured before baked the old decisions in: recapture them."""
        self.destroy()
        self.config = config
        self._resources = replace(self._resources, launch_with_pdl=config.launch_with_pdl)
        self.dispatcher = FusionDispatcher(config.cache_size, self._environment(workspace_ready=False))
        self.setup()

    def reserve(self, max_tokens: int) -> bool:
        """Grow the workspace (and the fusion limit) to ``max_tokens``; call before CUDA-graph
        capture. Returns whether the fused path can take that many tokens."""
        env = self.dispatcher.environment
        if env.static_reason() is not None:
            return False
        if self.config.backend == "flashinfer" and not self.workspace.ensure(max_tokens, self.hidden_size, self.dtype):
            self._update(replace(env, enabled=False, disabled_reason=f"workspace growth failed ({self.workspace.failure})"))
            return False
        self._update(replace(env, max_tokens=max(max_tokens, env.max_tokens)))
        return True

    def destroy(self) -> None:
        """Free the workspace and the symmetric buffers (on every rank, before the process groups)."""
        self.workspace.destroy()
        self.symm_mem.destroy()
        self.symm_fused.destroy()
        self._update(replace(self.dispatcher.environment, workspace_ready=False, table=None, symm_mem_tokens=0,
                             symm_fused_tokens=0))

    # ---- the cached decision

    def should_fuse_allreduce_residual_rmsnorm(self, layer_id: int, batch_size: int) -> bool:
        """Does layer ``layer_id`` with ``batch_size`` tokens fuse its reductions (and defer its
        MLP all-reduce into the next norm)? Cached; identical on every rank."""
        return self.dispatcher.should_fuse_allreduce_residual_rmsnorm(layer_id, batch_size)

    def strategy(self, layer_id: int, num_tokens: int) -> Strategy:
        """The `Strategy` of layer ``layer_id``'s reductions at ``num_tokens`` tokens, cached."""
        return self.dispatcher.strategy(layer_id, num_tokens)

    def cache_info(self) -> Any:
        return self.dispatcher.cache_info()

    def cache_clear(self) -> None:
        self.dispatcher.cache_clear()

    @property
    def active(self) -> bool:
        """True when some batch size can take a fused strategy."""
        return self.dispatcher.environment.static_reason() is None

    # ---- the hot path

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                                eps: float, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(sum(x) + residual), sum(x) + residual)`` by layer ``layer_id``'s strategy;
        ``x`` (this rank's partial sum) and ``residual`` are consumed."""
        self._refuse_owed("an all-reduce of layer %d" % layer_id)
        check_fusion_inputs(x, residual, weight)
        out = self._run(self.strategy(layer_id, x.shape[0]), x, residual, weight, eps, None)
        return out.normed, out.residual

    def defer_all_reduce(self, x: torch.Tensor, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s MLP output: reduced now (in place) when its strategy is ``nccl``,
        else owed to the next `add_rms_norm` and returned un-reduced."""
        strategy = self.strategy(layer_id, x.shape[0])
        if strategy is Strategy.NCCL:
            self.group.all_reduce(x)
            self.counts[strategy] += 1
            return x
        self._refuse_owed("a deferral of layer %d" % layer_id)
        self._owed = OwedReduction(layer_id, x.shape[0], strategy)
        return x

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``, taking layer ``layer_id``'s owed all-reduce
        of ``x`` when there is one (fused into this norm), else ``x`` is already reduced.
        Inputs consumed (see `fusion.norm.add_rms_norm`)."""
        owed, self._owed = self._owed, None
        if owed is None:
            return norm.add_rms_norm(x, residual, weight, eps)
        if (owed.layer_id, owed.num_tokens) != (layer_id, x.shape[0]):
            raise RuntimeError(f"the all-reduce deferred by layer {owed.layer_id} ({owed.num_tokens} tokens) was not "
                               f"taken by the next norm (layer {layer_id}, {x.shape[0]} tokens)")
        check_fusion_inputs(x, residual, weight)
        out = self._run(owed.strategy, x, residual, weight, eps, None)
        return out.normed, out.residual

    def begin_forward(self) -> None:
        """A forward starts (layer 0): nothing is owed; a record left by a forward that raised
        half-way is dropped with that forward's outputs."""
        self._owed = None

    def run(self, strategy: Strategy, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
            eps: float, quant: Optional[Quant] = None) -> FusedOutput:
        """One reduction by an explicit ``strategy`` (tuner, benchmarks, tests): checked inputs,
        then `_run`."""
        check_fusion_inputs(x, residual, weight)
        return self._run(Strategy(strategy), x, residual, weight, eps, quant)

    def _run(self, strategy: Strategy, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
             eps: float, quant: Optional[Quant]) -> FusedOutput:
        if not self.fits(strategy, x):
            strategy = Strategy.NCCL
        self.counts[strategy] += 1
        return RUNNERS[strategy](self._resources, x, residual, weight, eps, quant)

    def fits(self, strategy: Strategy, x: torch.Tensor) -> bool:
        """The strategy's buffers exist on every rank and hold ``x``."""
        if strategy is Strategy.FLASHINFER_ONE_SHOT or strategy is Strategy.FLASHINFER_TWO_SHOT:
            return self.workspace.fits(x.shape[0], x.shape[1], x.dtype)
        if strategy is Strategy.SYMM_MEM_FUSED:
            return self.symm_fused.fits(x)
        if strategy is Strategy.SYMM_MEM_TWO_SHOT:
            return self.symm_mem.fits(x)
        return True

    def _refuse_owed(self, what: str) -> None:
        if self._owed is not None:
            owed, self._owed = self._owed, None
            raise RuntimeError(f"the all-reduce deferred by layer {owed.layer_id} was never performed: {what} came "
                               f"first (each deferral must be taken by the next layer's input norm or the final norm)")

    # ---- environment and status

    def _update(self, env: FusionEnvironment) -> None:
        self.dispatcher.update_environment(env)
        self._resources = replace(self._resources, workspace=self.workspace.handle)

    def _environment(self, workspace_ready: bool) -> FusionEnvironment:
        cfg = self.config
        disabled = ("deterministic mode keeps NCCL's summation order, so fusion is off" if cfg.deterministic
                    else FusionEnvironment.disabled_reason)
        return FusionEnvironment(
            enabled=cfg.enabled and not cfg.deterministic,
            backend=cfg.backend,
            world_size=self.group.world_size,
            spans_nodes=self.group.spans_nodes,
            hidden_size=self.hidden_size,
            dtype=self.dtype,
            max_tokens=cfg.max_tokens,
            device_sm=device_capability(self.group.device),
            flashinfer_error=flashinfer_import_error() if cfg.backend == "flashinfer" else None,
            workspace_ready=workspace_ready,
            one_shot_max_input_bytes=cfg.one_shot_max_input_bytes,
            disabled_reason=disabled,
        )

    def _with_table(self, env: FusionEnvironment) -> FusionEnvironment:
        """Collective: the strategy table every rank uses (rank 0's, broadcast: packaged or
        ``table_path``; else measured now when ``tune_at_startup``; else none, and the built-in
        rule decides) and the symmetric-memory buffers of the strategies it picks anywhere."""
        table = None
        if (self.config.table_path or "").lower() != NO_TABLE:  # the same config on every rank
            table = self.group.broadcast_object(self._read_table() if self.group.rank == 0 else None)
            if table is None and self.config.table_path is None and self.config.tune_at_startup:
                table = tune_at_startup(self, self.config.tuning_cache_dir, self.config.tuning_budget_s)
        if table is not None:
            picked = {min(row, key=row.__getitem__) for row in table.timings_us}
        else:
            picked = rule_picks(max(self.config.max_tokens, self.config.symm_max_tokens or 0), self.hidden_size,
                                self.dtype, self.group.world_size)
        tokens, hidden, dtype = self.config.max_tokens, self.hidden_size, self.dtype
        symm_tokens = (tokens if Strategy.SYMM_MEM_TWO_SHOT in picked and self.symm_mem.ensure(tokens, hidden, dtype)
                       else 0)
        rows = self.config.symm_max_tokens or tokens
        fused_rows = rows if Strategy.SYMM_MEM_FUSED in picked and self.symm_fused.ensure(rows, hidden, dtype) else 0
        return replace(env, table=table, symm_mem_tokens=symm_tokens, symm_fused_tokens=fused_rows)

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
        """What /get_server_info shows: whether the fused path is active and why not."""
        env = self.dispatcher.environment
        info = self.dispatcher.cache_info()
        ws = self.workspace.shape
        return {
            "requested": self.config.enabled,
            "active": self.active,
            "backend": self.config.backend,
            "reason_inactive": env.static_reason(),
            "max_tokens": env.max_tokens,
            "measured_strategy_table": env.table is not None,
            "symmetric_buffer_tokens": {Strategy.SYMM_MEM_TWO_SHOT.value: env.symm_mem_tokens,
                                        Strategy.SYMM_MEM_FUSED.value: env.symm_fused_tokens},
            "workspace": None if ws is None else {"max_tokens": ws.max_tokens, "hidden": ws.hidden, "dtype": str(ws.dtype)},
            "cache": {"hits": info.hits, "misses": info.misses, "maxsize": info.maxsize, "currsize": info.currsize},
            "reductions": {s.value: n for s, n in sorted(self.counts.items())},
        }

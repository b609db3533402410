"""The cached decision: how does this (layer, batch) run all-reduce + residual + RMSNorm?

`FusionDispatcher.strategy(layer_id, num_tokens)` picks a `fusion.strategies.Strategy`
(``nccl`` is the unfused path) and `should_fuse_allreduce_residual_rmsnorm(layer_id, batch_size)` is
"anything but nccl". Both answer from a `FusionEnvironment` that is identical on every rank
(its inputs are rank-independent; per-rank failures such as a workspace allocation are voted,
and a measured table is rank 0's, broadcast), so the answer is identical on every rank.
Answers sit in a bounded LRU (functools.lru_cache: a C implementation) keyed on
(layer_id, batch_size); it is cleared whenever the environment (workspace, table) changes.

With a measured table (`fusion.dispatch.table`: packaged, given, or measured at start-up) the
fastest available strategy of the batch's bucket wins; without one, the built-in rule
(`fusion.dispatch.cost_model`): the available strategy a cost model fitted to measurements over hidden
sizes predicts fastest, from the message bytes and rows per rank. A world size the model does
not cover takes flashinfer's kernel (one-shot or two-shot by message size) up to the workspace.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from fusion.config import DEFAULT_CACHE_SIZE
from fusion.dispatch.cost_model import cheapest
from fusion.dispatch.one_shot import choose_one_shot
from fusion.platform import FUSED_KERNEL_SM_MAJORS, hidden_alignment_error
from fusion.strategies import Strategy
from fusion.dispatch.table import StrategyTable


@dataclass(frozen=True)
class FusionEnvironment:
    """Everything the decision depends on. The defaults describe a process with no TP group:
    fusion off."""

    enabled: bool = False
    backend: str = "flashinfer"
    world_size: int = 1
    spans_nodes: bool = False
    hidden_size: int = 0
    dtype: torch.dtype = torch.bfloat16
    max_tokens: int = 0  # tokens the workspace (or, for the torch backend, the config) allows
    device_sm: Optional[tuple[int, int]] = None
    flashinfer_error: Optional[str] = None
    workspace_ready: bool = False  # the flashinfer backend's IPC workspace exists on all ranks
    symm_mem_tokens: int = 0  # tokens the symmetric-memory buffer holds on all ranks (0: none)
    symm_fused_tokens: int = 0  # rows per chunk of the fused two-shot kernels' buffer (0: none; any batch runs in chunks)
    one_shot_max_input_bytes: Optional[int] = None
    table: Optional[StrategyTable] = None  # measured timings for this GPU, TP size, hidden, dtype
    disabled_reason: str = "fusion is not enabled (--enable-flashinfer-allreduce-fusion)"

    def static_reason(self) -> Optional[str]:
        """Why fusion can never run in this environment, whatever the batch; None if it can."""
        if not self.enabled:
            return self.disabled_reason
        if self.world_size == 1:
            return "TP size is 1: there is nothing to all-reduce"
        if self.backend == "torch":
            return None
        if self.spans_nodes:
            return "the TP group spans nodes; the trtllm IPC workspace is single-node"
        if self.flashinfer_error:
            return self.flashinfer_error
        if self.device_sm is None:
            return "no CUDA device: the flashinfer fused kernel needs an sm90/sm100 GPU"
        if self.device_sm[0] not in FUSED_KERNEL_SM_MAJORS:
            return f"GPU is sm{self.device_sm[0]}{self.device_sm[1]}; the fused kernel needs sm90 or sm100"
        if self.hidden_size:
            aligned = hidden_alignment_error(self.hidden_size, self.dtype)
            if aligned:
                return aligned
        if not self.workspace_ready:
            return "no fusion workspace (not created yet)"
        return None


class FusionDispatcher:
    """Bounded-LRU cached fusion decision for one model (one hidden size and dtype)."""

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE, environment: Optional[FusionEnvironment] = None) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self.cache_size = cache_size
        self._environment = environment or FusionEnvironment()
        self._static_reason = self._environment.static_reason()
        self._cached = functools.lru_cache(maxsize=cache_size)(self._decide)

    @property
    def environment(self) -> FusionEnvironment:
        return self._environment

    def update_environment(self, environment: FusionEnvironment) -> None:
        """Swap in a new environment (a workspace grew, a table changed) and clear the cache."""
        self._environment = environment
        self._static_reason = environment.static_reason()
        self.cache_clear()

    def should_fuse_allreduce_residual_rmsnorm(self, layer_id: int, batch_size: int) -> bool:
        """True when layer ``layer_id`` with ``batch_size`` tokens should defer its MLP
        all-reduce into the next norm (and fuse its attention all-reduce into its own)."""
        return self._cached(layer_id, batch_size) != Strategy.NCCL

    def strategy(self, layer_id: int, num_tokens: int) -> Strategy:
        """The `Strategy` for this layer and token count, cached."""
        return self._cached(layer_id, num_tokens)

    def cache_info(self) -> functools._CacheInfo:
        """(hits, misses, maxsize, currsize), as functools.lru_cache reports them."""
        return self._cached.cache_info()

    def cache_clear(self) -> None:
        self._cached.cache_clear()

    def why_not(self, layer_id: int, batch_size: int) -> Optional[str]:
        """None when a fused strategy applies, else the reason it does not (uncached)."""
        return self._decide_with_reason(layer_id, batch_size)[1]

    def _decide(self, layer_id: int, batch_size: int) -> Strategy:
        return self._decide_with_reason(layer_id, batch_size)[0]

    def _decide_with_reason(self, layer_id: int, batch_size: int) -> tuple[Strategy, Optional[str]]:
        if layer_id < 0:
            raise ValueError(f"layer_id must be >= 0, got {layer_id}")
        if self._static_reason:
            return Strategy.NCCL, self._static_reason
        env = self._environment
        if batch_size <= 0:
            return Strategy.NCCL, "empty batch"
        if env.backend == "torch":
            if batch_size > env.max_tokens:
                return Strategy.NCCL, f"{batch_size} tokens exceed the fusion limit of {env.max_tokens} tokens"
            return Strategy.TORCH, None
        available = self._available(batch_size)
        if available == [Strategy.NCCL]:
            return Strategy.NCCL, f"{batch_size} tokens exceed the fusion limit of {env.max_tokens} tokens"
        if env.table is not None:
            best = env.table.fastest(batch_size, available)
            if best is not None:
                return best, (f"measured: nccl is fastest for {batch_size} tokens" if best == Strategy.NCCL else None)
        modelled = cheapest(self._within_one_shot_limit(batch_size, available), batch_size, env.hidden_size,
                            env.dtype, env.world_size)
        if modelled is not None:
            return modelled, (f"cost model: nccl is fastest for {batch_size} tokens" if modelled == Strategy.NCCL
                              else None)
        if batch_size > env.max_tokens:  # an unmodelled world size: flashinfer's kernel or nccl
            return Strategy.NCCL, f"{batch_size} tokens exceed the fusion limit of {env.max_tokens} tokens"
        one_shot = choose_one_shot(batch_size, env.hidden_size, env.dtype, env.world_size, env.one_shot_max_input_bytes)
        return (Strategy.FLASHINFER_ONE_SHOT if one_shot else Strategy.FLASHINFER_TWO_SHOT), None

    def _within_one_shot_limit(self, batch_size: int, available: list[Strategy]) -> list[Strategy]:
        """``available`` less one-shot above a configured one-shot input-size limit."""
        limit = self._environment.one_shot_max_input_bytes
        if limit is None or batch_size * self._environment.hidden_size * self._environment.dtype.itemsize <= limit:
            return available
        return [s for s in available if s != Strategy.FLASHINFER_ONE_SHOT]

    def _available(self, batch_size: int) -> list[Strategy]:
        """Strategies that can run a batch of this size here (flashinfer backend)."""
        env = self._environment
        out = [Strategy.NCCL]
        if batch_size <= env.max_tokens:
            out.append(Strategy.FLASHINFER_ONE_SHOT)
            if batch_size > env.world_size:
                out.append(Strategy.FLASHINFER_TWO_SHOT)
        if batch_size <= env.symm_mem_tokens:
            out.append(Strategy.SYMM_MEM_TWO_SHOT)
        if env.symm_fused_tokens:
            out.append(Strategy.SYMM_MEM_FUSED)  # chunked beyond the buffer: every step is row-wise
        return out

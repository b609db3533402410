"""`AllReduceFusion`: the fused op for one TP group and one model, with its workspace and
its cached dispatch decision.

An engine makes one per TP group after the process groups exist, calls `setup()` (and
`reserve()` to grow) before CUDA-graph capture, asks `strategy(layer_id, tokens)` (or just
`should_fuse`) at every reduction point and calls `all_reduce_add_rms_norm(..., strategy)`,
which always performs the all-reduce: by the chosen strategy when its buffers hold the input,
otherwise through the unfused reference path.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from fusion import strategies as st
from fusion.dispatch import FusionDispatcher, FusionEnvironment
from fusion.group import TensorParallelGroup
from fusion.ops import add_rms_norm_after_reduce, allreduce_residual_rmsnorm, unfused_allreduce_residual_rmsnorm
from fusion.platform import device_capability, flashinfer_import_error
from fusion.symm_mem_allreduce import SymmMemAllReduce
from fusion.symm_mem_fused import SymmMemFusedAllReduceNorm
from fusion.tuning_table import PACKAGED_TABLE, read_table, select_table
from fusion.validation import check_fusion_inputs
from fusion.workspace import AllReduceFusionWorkspace, WorkspaceFactory

logger = logging.getLogger(__name__)

FUSION_BACKENDS = ("flashinfer", "torch")
NO_TABLE = "none"  # table_path value: no measured table, the built-in thresholds decide


@dataclass(frozen=True)
class FusionConfig:
    """What the user asked for (from ServerArgs, passed down as plain values)."""

    enabled: bool = False
    backend: str = "flashinfer"  # "flashinfer" (trtllm kernel) or "torch" (same math, any device)
    max_tokens: int = 2048  # largest batch (tokens) the fused path takes; sizes the workspace
    cache_size: int = 64  # bound of the (layer_id, batch_size) decision cache
    deterministic: bool = False  # keeps NCCL's summation order: disables fusion
    oneshot_max_input_bytes: Optional[int] = None  # overrides the one-shot/two-shot threshold
    launch_with_pdl: bool = True  # launch the flashinfer kernel with programmatic dependent launch
    table_path: Optional[str] = None  # measured strategy table (python -m fusion.tune); None: the packaged one; "none": no table
    # rows the fused two-shot buffer holds (larger batches run in chunks of it); None: max_tokens.
    # An engine passes its largest prefill: eager chunks of a few thousand rows are host-bound
    # (five launches per chunk), one chunk per prefill is not.
    symm_max_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.backend not in FUSION_BACKENDS:
            raise ValueError(f"fusion backend must be one of {FUSION_BACKENDS}, got {self.backend!r}")
        if self.max_tokens < 1:
            raise ValueError(f"fusion max_tokens must be >= 1, got {self.max_tokens}")
        if self.symm_max_tokens is not None and self.symm_max_tokens < 1:
            raise ValueError(f"fusion symm_max_tokens must be >= 1, got {self.symm_max_tokens}")


class AllReduceFusion:
    """All-reduce + residual add + RMSNorm for one TP group, fused where it pays."""

    def __init__(
        self,
        group: TensorParallelGroup,
        config: FusionConfig,
        hidden_size: int,
        dtype: torch.dtype,
        workspace_factory: Optional[WorkspaceFactory] = None,
    ) -> None:
        self.group = group
        self.config = config
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.workspace = AllReduceFusionWorkspace(group, workspace_factory)
        self.symm_mem = SymmMemAllReduce(group)
        self.symm_fused = SymmMemFusedAllReduceNorm(group)
        self._uses_workspace = config.backend == "flashinfer"
        self.dispatcher = FusionDispatcher(config.cache_size, self._environment(workspace_ready=False))

    def _environment(self, workspace_ready: bool) -> FusionEnvironment:
        cfg = self.config
        enabled = cfg.enabled and not cfg.deterministic
        disabled = (
            "deterministic mode keeps NCCL's summation order, so fusion is off"
            if cfg.deterministic
            else FusionEnvironment.disabled_reason
        )
        return FusionEnvironment(
            enabled=enabled,
            backend=cfg.backend,
            world_size=self.group.world_size,
            spans_nodes=self.group.spans_nodes,
            hidden_size=self.hidden_size,
            dtype=self.dtype,
            max_tokens=cfg.max_tokens,
            device_sm=device_capability(self.group.device),
            flashinfer_error=flashinfer_import_error() if cfg.backend == "flashinfer" else None,
            workspace_ready=workspace_ready,
            oneshot_max_input_bytes=cfg.oneshot_max_input_bytes,
            disabled_reason=disabled,
        )

    def setup(self) -> None:
        """Collective: agree on whether fusion can run, create the workspace if it needs one.
        Logs once (rank 0) why fusion stays off when it was asked for."""
        env = self._environment(workspace_ready=True)  # everything but the workspace
        reasons = self.group.all_gather_object(env.static_reason())
        reason = next((r for r in reasons if r), None)  # identical on every rank
        if reason is None and self._uses_workspace:
            if not self.workspace.ensure(self.config.max_tokens, self.hidden_size, self.dtype):
                reason = f"workspace creation failed ({self.workspace.failure})"
        if reason:
            env = replace(env, enabled=False, disabled_reason=reason)
        elif self._uses_workspace:
            env = self._with_table(env)
        self.dispatcher.update_environment(env)
        if self.config.enabled and reason and self.group.rank == 0:
            logger.warning("all-reduce fusion was requested but runs unfused: %s", reason)

    def _with_table(self, env: FusionEnvironment) -> FusionEnvironment:
        """Collective: rank 0's measured table for this GPU, TP size, hidden and dtype, on every
        rank; the symmetric-memory buffers of the strategies the table picks somewhere."""
        if (self.config.table_path or "").lower() == NO_TABLE:
            return env  # the same config on every rank: nobody reads or broadcasts a table
        table = None
        if self.group.rank == 0:
            gpu = torch.cuda.get_device_name(self.group.device) if self.group.device.type == "cuda" else "cpu"
            path = self.config.table_path or PACKAGED_TABLE
            entries = read_table(path)
            table = select_table(entries, gpu, self.group.world_size, self.hidden_size, str(self.dtype).removeprefix("torch."))
            if entries is not None and table is None and self.config.table_path:
                logger.warning("strategy table %s has no entry for %s, TP%d, hidden %d, %s: using the built-in "
                               "thresholds", path, gpu, self.group.world_size, self.hidden_size, self.dtype)
        table = self.group.broadcast_object(table)
        if table is None:
            return env
        picked = {min(row, key=row.__getitem__) for row in table.timings_us}
        tokens, hidden, dtype = self.config.max_tokens, self.hidden_size, self.dtype
        symm_tokens = tokens if st.SYMM_MEM_TWO_SHOT in picked and self.symm_mem.ensure(tokens, hidden, dtype) else 0
        rows = self.config.symm_max_tokens or tokens
        fused_tokens = rows if st.SYMM_MEM_FUSED in picked and self.symm_fused.ensure(rows, hidden, dtype) else 0
        return replace(env, table=table, symm_mem_tokens=symm_tokens, symm_fused_tokens=fused_tokens)

    def reserve(self, max_tokens: int) -> bool:
        """Collective: grow the workspace (and the fusion limit) to ``max_tokens``. Call before
        CUDA-graph capture. Returns whether the fused path can take that many tokens."""
        if self.dispatcher.environment.static_reason() is not None:
            return False
        if self._uses_workspace and not self.workspace.ensure(max_tokens, self.hidden_size, self.dtype):
            reason = f"workspace growth failed ({self.workspace.failure})"
            self.dispatcher.update_environment(replace(self.dispatcher.environment, enabled=False, disabled_reason=reason))
            return False
        limit = max(max_tokens, self.dispatcher.environment.max_tokens)
        self.dispatcher.update_environment(replace(self.dispatcher.environment, max_tokens=limit))
        return True

    @property
    def active(self) -> bool:
        """True when some batch size can take the fused path."""
        return self.dispatcher.environment.static_reason() is None

    def should_fuse(self, layer_id: int, num_tokens: int) -> bool:
        return self.dispatcher.should_fuse_allreduce_residual_rmsnorm(layer_id, num_tokens)

    def strategy(self, layer_id: int, num_tokens: int) -> str:
        return self.dispatcher.strategy(layer_id, num_tokens)

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float, strategy: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(sum(x) + residual), sum(x) + residual)`` by ``strategy`` (see
        `fusion.strategies`); ``x``/``residual`` consumed. A strategy whose buffers cannot hold
        the input runs as ``nccl``. Either way the all-reduce happens exactly once."""
        tokens, hidden = x.shape
        if strategy in st.FLASHINFER_STRATEGIES and self.workspace.fits(tokens, hidden, x.dtype):
            return allreduce_residual_rmsnorm(
                x, residual, weight, eps, group=self.group, backend="flashinfer", workspace=self.workspace.handle,
                use_oneshot=strategy == st.FLASHINFER_ONESHOT, launch_with_pdl=self.config.launch_with_pdl,
            )
        if strategy == st.TORCH_FUSED:
            return allreduce_residual_rmsnorm(x, residual, weight, eps, group=self.group, backend="torch")
        if strategy == st.SYMM_MEM_FUSED and self.symm_fused.fits(x):
            return self.symm_fused(x, residual, weight, eps)
        if strategy == st.SYMM_MEM_TWO_SHOT and self.symm_mem.fits(x):
            check_fusion_inputs(x, residual, weight)
            self.symm_mem.all_reduce(x)
            self.group.counters.fused += 1
            return add_rms_norm_after_reduce(x, residual, weight, eps)
        return unfused_allreduce_residual_rmsnorm(x, residual, weight, eps, self.group)

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
            "symmetric_buffer_tokens": {st.SYMM_MEM_TWO_SHOT: env.symm_mem_tokens, st.SYMM_MEM_FUSED: env.symm_fused_tokens},
            "workspace": None if ws is None else {"max_tokens": ws.max_tokens, "hidden": ws.hidden, "dtype": str(ws.dtype)},
            "cache": {"hits": info.hits, "misses": info.misses, "maxsize": info.maxsize, "currsize": info.currsize},
            "reductions": {
                "total": self.group.counters.total,
                "fused": self.group.counters.fused,
                "flashinfer": self.group.counters.flashinfer,
            },
        }

    def destroy(self) -> None:
        """Free the workspace and the symmetric buffer (on every rank, before destroying the
        process groups)."""
        self.workspace.destroy()
        self.symm_mem.destroy()
        self.symm_fused.destroy()

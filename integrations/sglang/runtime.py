"""The one arfusion fusion op of an SGLang TP process: made where SGLang makes its flashinfer
workspace (``pre_initialize_workspaces``, before CUDA-graph capture), freed where SGLang frees it
(``cleanup_flashinfer_workspace``) and at exit.

The op (`fusion.AllReduceFusion`) lives on SGLang's TP group (`SGLangTPGroup`) with the model's
hidden size and dtype: its backends (flashinfer one-shot / two-shot on one IPC workspace, our
symmetric-memory two-shot with the norm fused, our Lamport one-shot) and its cached decision. On
a device other than CUDA the op is arfusion's torch backend (the same semantics, no kernels).
"""
from __future__ import annotations

import atexit
import collections
import logging
from typing import Any, Optional

import torch

from arfusion.fusion import AllReduceFusion, FusionConfig
from arfusion.integrations.sglang.group import SGLangTPGroup

logger = logging.getLogger(__name__)

_op: Optional[AllReduceFusion] = None
# reductions the plugin ran outside the op (SGLang's all-reduce + norm), by reason
unfused: collections.Counter[str] = collections.Counter()


def fusion_op() -> Optional[AllReduceFusion]:
    """This process's fusion op, or None before SGLang pre-initialises its workspace."""
    return _op


def create(coordinator: Any, max_tokens: int, hidden_size: int, dtype: torch.dtype,
           symm_max_tokens: Optional[int] = None, node_rank: int = 0) -> AllReduceFusion:
    """Collective over ``coordinator``'s ranks: the fusion op for ``hidden_size`` x ``dtype``
    reductions of up to ``max_tokens`` tokens in flashinfer's workspace (``symm_max_tokens``:
    the rows of our symmetric two-shot buffer, e.g. the prefill chunk), set up on every rank.
    An op made before for the same group, hidden size and dtype is grown instead; another is
    destroyed first. Logs (rank 0) whether the fused path is active and why not."""
    global _op
    if _op is not None and _op.hidden_size == hidden_size and _op.dtype == dtype \
            and _op.group.ranks == list(coordinator.ranks):
        _op.reserve(max_tokens)
        return _op
    destroy()
    group = SGLangTPGroup(coordinator, node_rank)
    backend = "flashinfer" if group.device.type == "cuda" else "torch"
    config = FusionConfig(enabled=True, backend=backend, max_tokens=max_tokens,
                          symm_max_tokens=symm_max_tokens if symm_max_tokens and symm_max_tokens > max_tokens else None)
    op = AllReduceFusion(group, config, hidden_size, dtype)
    op.setup()
    _op = op
    if group.rank == 0:
        info = op.status()
        logger.info("arfusion replaces SGLang's fused all-reduce + residual + RMSNorm (TP %d, hidden %d, %s): "
                    "active=%s%s, tokens per strategy %s, measured table %s", group.world_size, hidden_size, dtype,
                    info["active"], "" if info["active"] else f" ({info['reason_inactive']})",
                    info["backend_tokens"], info["measured_strategy_table"])
    return op


def destroy() -> None:
    """Free the op's buffers on this rank (idempotent); logs its counters (rank 0)."""
    global _op
    op, _op = _op, None
    if op is None:
        return
    if op.group.rank == 0:
        logger.info("arfusion: %s", status(op))
    op.destroy()


def status(op: Optional[AllReduceFusion] = None) -> dict[str, Any]:
    """The op's status (`AllReduceFusion.status`: active, why not, reductions by strategy,
    decision cache hits / misses) and the plugin's unfused reductions by reason."""
    op = op or _op
    info: dict[str, Any] = op.status() if op is not None else {"active": False, "reason_inactive": "not created yet"}
    info["unfused_by_plugin"] = dict(unfused)
    return info


atexit.register(destroy)

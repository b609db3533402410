"""The fusion ops the plugin's custom ops run, one per (hidden size, dtype, device) in a TP process.

An op (`fusion.AllReduceFusion`) is made the first time a reduction of its shape runs for real:
vLLM's profile and warm-up runs execute the compiled model on every rank in step, before any
CUDA-graph capture, so the op's collective ``setup`` (the agreement on fusion, the workspace or
symmetric buffers) happens there, on every rank together. Making one while a CUDA graph is
being captured is refused with an error. The ops are destroyed at process exit (``atexit``),
before the process groups vLLM tears down in its own, earlier registered, exit handlers.

Over which group: vLLM's tensor-parallel `GroupCoordinator` (its ``device_group``, NCCL on GPU and
gloo on CPU, and its gloo ``cpu_group`` for votes). The op's config: enabled; backend
"flashinfer" on CUDA (our strategies and the measured table), "torch" elsewhere (the reference
fused path, for CPU tests); the flashinfer workspace sized for ``min(2048, max_num_batched_tokens)``
tokens and our symmetric-memory two-shot for vLLM's largest batch (``max_num_batched_tokens``),
so prefills beyond flashinfer's limit still fuse.
"""
from __future__ import annotations

import atexit
import collections
import logging
from typing import Any, Callable, Optional

import torch

from arfusion.fusion import AllReduceFusion, FusionConfig, TensorParallelGroup
from arfusion.fusion.platform import is_capturing_cuda_graph

logger = logging.getLogger(__name__)
FLASHINFER_MAX_TOKENS = 2048  # the flashinfer workspace's rows (FusionConfig's default)
DEFAULT_MAX_BATCHED_TOKENS = 8192  # when no vLLM config is current (vLLM's default budget)

_OPS: dict[tuple[int, torch.dtype, torch.device], AllReduceFusion] = {}
calls: collections.Counter[int] = collections.Counter()  # op calls, by reduction site
graphs: list[dict[str, Any]] = []  # per graph the pass rewrote here: sites replaced (by all-reduce form), collectives kept (by form)


def vllm_group() -> TensorParallelGroup:
    """vLLM's TP group as a `fusion.TensorParallelGroup` (collective: node and device identities
    are exchanged over the CPU group, so that the op sees TP groups that span nodes)."""
    from vllm.distributed.parallel_state import get_tp_group

    coord = get_tp_group()
    device = torch.device(coord.device)
    if coord.world_size == 1:
        return TensorParallelGroup(0, 1, device)
    me = (TensorParallelGroup.node_identity(0), TensorParallelGroup.device_identity(device))
    out: list[Any] = [None] * coord.world_size
    torch.distributed.all_gather_object(out, me, group=coord.cpu_group)
    return TensorParallelGroup(coord.rank_in_group, coord.world_size, device, coord.device_group, coord.cpu_group,
                               [o[0] for o in out], [o[1] for o in out])


def max_batched_tokens() -> int:
    """vLLM's largest batch (``scheduler_config.max_num_batched_tokens``) when a vLLM config is
    current, else `DEFAULT_MAX_BATCHED_TOKENS`."""
    try:
        from vllm.config import get_current_vllm_config_or_none as current
    except ImportError:
        try:  # older releases: only the accessor that raises when no config is current
            from vllm.config import get_current_vllm_config as current
        except ImportError:  # no vLLM: the ops run outside the engine (their own tests)
            return DEFAULT_MAX_BATCHED_TOKENS
    try:
        config = current()
    except AssertionError:
        config = None
    if config is None or config.scheduler_config is None:
        return DEFAULT_MAX_BATCHED_TOKENS
    return int(config.scheduler_config.max_num_batched_tokens)


def fusion_config(device: torch.device, max_tokens: int) -> FusionConfig:
    """The op's config on ``device`` for batches of up to ``max_tokens`` tokens (module docstring)."""
    if device.type != "cuda":
        return FusionConfig(enabled=True, backend="torch", max_tokens=max_tokens)
    return FusionConfig(enabled=True, backend="flashinfer", max_tokens=min(FLASHINFER_MAX_TOKENS, max_tokens),
                        symm_max_tokens=max_tokens)


# Where the ops' TP group comes from: vLLM's (the ops' own tests hand in the project's group)
group_source: Callable[[], TensorParallelGroup] = vllm_group


def fusion_for(x: torch.Tensor) -> AllReduceFusion:
    """The op for ``x``'s hidden size, dtype and device; made (collectively) on first use."""
    key = (x.shape[-1], x.dtype, x.device)
    op = _OPS.get(key)
    if op is None:
        op = _make(key)
    return op


def _make(key: tuple[int, torch.dtype, torch.device]) -> AllReduceFusion:
    hidden, dtype, device = key
    if is_capturing_cuda_graph():
        raise RuntimeError(f"arfusion: the fusion op for hidden {hidden} {dtype} would be created during CUDA-graph "
                           "capture; it must exist before (vLLM's profile and warm-up runs make it)")
    if not _OPS:
        atexit.register(destroy_all)
    group = group_source()
    op = AllReduceFusion(group, fusion_config(device, max_batched_tokens()), hidden, dtype)
    op.setup()
    _OPS[key] = op
    if group.rank == 0:
        status = op.status()
        logger.warning("arfusion: fused all-reduce + RMSNorm op ready on %s (hidden %d, %s, TP%d): active=%s, "
                       "backend=%s, tokens=%s%s", device, hidden, dtype, group.world_size, status["active"],
                       status["backend"], status["backend_tokens"],
                       f", runs unfused: {status['reason_inactive']}" if status["reason_inactive"] else "")
    return op


def destroy_all() -> None:
    """Free every op's buffers on this rank (idempotent)."""
    while _OPS:
        _, op = _OPS.popitem()
        op.destroy()


def stats() -> dict[str, Any]:
    """This process's counters: per rewritten graph the sites replaced and the collectives kept (by form),
    op calls per site, and each fusion op's status (reductions by strategy, decision-cache hits
    and misses)."""
    return {
        "graphs": list(graphs),
        "calls": dict(calls),
        "ops": {f"{h}/{str(d).removeprefix('torch.')}/{dev}": op.status() for (h, d, dev), op in _OPS.items()},
    }


def worker_stats(worker: Optional[object] = None) -> dict[str, Any]:
    """`stats` for ``LLM.collective_rpc(worker_stats)`` (vLLM passes the worker; unused)."""
    return stats()

"""The functions that take the place of SGLang's fused all-reduce + residual + RMSNorm path, and
the table that registers them (`HOOKS`: target, hook, hook type of SGLang's ``HookRegistry``).

    apply_flashinfer_allreduce_fusion(batch_size)   the gate: SGLang's own conditions (its flag,
                                                    sm90/sm100, flashinfer, no DP attention)
                                                    without its 2048-token bound, then our cached
                                                    decision for (layer, batch_size)
    flashinfer_allreduce_residual_rmsnorm(...)      the fused call: our op by the layer's strategy;
                                                    where SGLang's would give up it reduces unfused
    pre_initialize_workspaces(...)                  makes our op (collective, before graph capture)
    cleanup_flashinfer_workspace()                  frees it
    ModelRunner.forward (after)                     a peer's stall seen by a bounded wait fails
                                                    the step with a named error

Fallbacks are never silent: SGLang's caller (``RMSNorm.forward_with_allreduce_fusion``) treats
``(None, None)`` as "not fused" and then runs only the norm, without the all-reduce it owed. So
the fused call answers ``(None, None)`` only where no reduction is owed (a group of one rank);
everywhere else that SGLang's call would give up (tensors not contiguous, our op missing or
destroyed, a hidden size, dtype, device or group the op was not made for) it runs SGLang's own
all-reduce and the add + RMSNorm itself.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from arfusion.fusion import PartialSum, norm
from arfusion.integrations.sglang import layer_scope, runtime

_COMM = "sglang.srt.layers.communicator"
_FUSION = "sglang.srt.layers.flashinfer_comm_fusion"


def gate(original: Callable[[int], bool], batch_size: int) -> bool:
    """AROUND hook of ``apply_flashinfer_allreduce_fusion``: does a reduction of ``batch_size``
    tokens of the current layer take the fused path? SGLang's own conditions come from its gate
    asked about one token (they do not depend on the size); its 2048-token bound is replaced by
    what our op's backends hold. Under torch.compile tracing: SGLang's unfused path."""
    if torch.compiler.is_compiling() or not original(1):
        return False
    op = runtime.fusion_op()
    return op is not None and op.should_fuse_allreduce_residual_rmsnorm(layer_scope.current(), batch_size)


def _coordinator(use_attn_tp_group: bool) -> Any:
    """The SGLang group a reduction runs over, chosen as SGLang's fused call chooses it."""
    from sglang.srt.distributed import parallel_state as ps

    if use_attn_tp_group:
        return ps.get_attn_tp_group()
    ep = ps.get_moe_ep_group()
    return ep if ep.world_size > 1 else ps.get_moe_tp_group()


def _unfit_reason(op: Any, coordinator: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why our op cannot take this call (None when it can)."""
    if op is None:
        return "no fusion op (SGLang did not pre-initialise its workspace)"
    if not op.active:
        return "fusion op inactive"
    if list(coordinator.ranks) != op.group.ranks:
        return "another group than the TP group"
    if not (x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()):
        return "tensors not contiguous"
    if x.dim() != 2 or x.shape[1] != op.hidden_size or x.dtype != op.dtype or x.device != op.group.device:
        return "shape, dtype or device the op was not made for"
    return None


def allreduce_residual_rmsnorm(input_tensor: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float = 1e-6, max_token_num: int = 2048, use_oneshot: Optional[bool] = None,
                               trigger_completion_at_end: bool = False, fp32_acc: bool = False,
                               use_attn_tp_group: bool = True) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """REPLACE of ``flashinfer_allreduce_residual_rmsnorm`` (same signature):
    ``(rms_norm(s + residual) * weight, s + residual)`` with ``s`` the sum of ``input_tensor``
    over the group, by the current layer's cached strategy. ``input_tensor`` and ``residual``
    are consumed (a strategy may write either in place). ``max_token_num``, ``use_oneshot``,
    ``trigger_completion_at_end`` and ``fp32_acc`` are SGLang's flashinfer settings: the
    strategy decides them here. ``(None, None)`` only when the group has one rank."""
    coordinator = _coordinator(use_attn_tp_group)
    if coordinator.world_size <= 1:
        return None, None
    op = runtime.fusion_op()
    reason = _unfit_reason(op, coordinator, input_tensor, residual, weight)
    if reason is None:
        return op.reduce_add_rms_norm(PartialSum(pending=input_tensor, layer_id=layer_scope.current(), op=op), residual,
                                      weight, eps)
    runtime.unfused[reason] += 1
    reduced = coordinator.all_reduce(input_tensor.contiguous())
    return norm.add_rms_norm(reduced, residual.contiguous(), weight.contiguous(), eps)


def pre_initialize_workspaces(max_token_num: int, hidden_dim: int, dtype: torch.dtype,
                              use_oneshot: Optional[bool] = None) -> None:
    """REPLACE of SGLang's ``pre_initialize_workspaces`` (called by every TP rank before CUDA-graph
    capture when its fused path is on): our op on SGLang's TP group, for ``max_token_num``
    tokens in flashinfer's workspace and the prefill chunk (``--chunked-prefill-size``) in our
    symmetric two-shot buffer. Collective."""
    from sglang.srt.distributed import parallel_state as ps

    chunk = _server_arg("chunked_prefill_size")
    runtime.create(ps.get_tp_group(), max_token_num, hidden_dim, dtype,
                   symm_max_tokens=chunk if isinstance(chunk, int) and chunk > 0 else None,
                   node_rank=_server_arg("node_rank") or 0)


def _server_arg(name: str) -> Any:
    """SGLang's server argument ``name``; None where the process has published none."""
    from sglang.srt.server_args import get_global_server_args

    try:
        return getattr(get_global_server_args(), name, None)
    except ValueError:  # "Global server args is not set yet!"
        return None


def cleanup_workspace(original: Callable[[], None]) -> None:
    """AROUND hook of ``cleanup_flashinfer_workspace``: free our op's buffers, then SGLang's."""
    runtime.destroy()
    original()


def raise_if_peer_stalled(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook of ``ModelRunner.forward``: `fusion.errors.FusionTimeoutError` once a kernel of
    our op gave up waiting for a stalled or dead peer (a host read, no device sync: seen once
    that kernel has completed, at the latest one step later), so that the step fails with a
    named error instead of returning garbage."""
    op = runtime.fusion_op()
    if op is not None:
        op.raise_if_failed()


def residual_not_read_only(*args: Any, **kwargs: Any) -> bool:
    """REPLACE of ``LayerCommunicator._post_attn_residual_is_read_only``: our strategies may
    write the residual in place (as SGLang's unfused norm does), so an auxiliary capture of it
    (Eagle3) must copy it."""
    return False


# (target, hook, HookType name); the last is registered only where the release has it
HOOKS: list[tuple[str, Callable[..., Any], str]] = [
    (f"{_COMM}.apply_flashinfer_allreduce_fusion", gate, "AROUND"),
    (f"{_FUSION}.flashinfer_allreduce_residual_rmsnorm", allreduce_residual_rmsnorm, "REPLACE"),
    (f"{_FUSION}.pre_initialize_workspaces", pre_initialize_workspaces, "REPLACE"),
    (f"{_FUSION}.cleanup_flashinfer_workspace", cleanup_workspace, "AROUND"),
    (f"{_COMM}.LayerCommunicator.__init__", layer_scope.number_communicator, "AFTER"),
    (f"{_COMM}.LayerCommunicator.should_fuse_mlp_allreduce_with_next_layer", layer_scope.own_layer, "AROUND"),
    (f"{_COMM}.LayerCommunicator.prepare_mlp", layer_scope.own_layer, "AROUND"),
    (f"{_COMM}.LayerCommunicator.prepare_attn", layer_scope.previous_layer, "AROUND"),
    ("sglang.srt.model_executor.model_runner.ModelRunner.forward", raise_if_peer_stalled, "AFTER"),
]
OPTIONAL_HOOKS: list[tuple[str, Callable[..., Any], str]] = [
    (f"{_COMM}.LayerCommunicator._post_attn_residual_is_read_only", residual_not_read_only, "REPLACE"),
]

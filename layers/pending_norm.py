"""The input norm of a decoder layer handed to its q/k/v projection unrun, so that at TP1 a
decode batch's residual add + RMSNorm runs inside the q/k/v matmul (one launch instead of the
norm's and the matmul's: layers/kernels/triton_norm_matmul.py).

    input_norm(norm, h, residual, fold)  -> (normed, residual)         as ``norm(h, residual)``
                                         or (PendingNorm, residual_out) when ``fold`` and the
                                            batch qualifies (`defer`)
    QKVParallelLinear(pending)           -> pending.linear(W, b): the one launch, where it serves
                                            W; else the separate norm, then the matmul
    pending.materialize()                -> the normed tensor by the separate norm (any other
                                            consumer: a `PendingNorm` is not a tensor)

A batch qualifies when the layer folds (``fold``: requested, and TP size 1: `folds`), it has a
residual (layer 0 normalises the embeddings alone, as before), batch-invariant mode is off, and
the launch takes it (`triton_norm_matmul.refusal`: CUDA fp16 / bf16, at most 32 tokens, hidden
size a multiple of 16). ``h`` is then the previous layer's `fusion.PartialSum` (a model defers
its MLP's reduction into this norm; at TP1 the sum is its own tensor, taken from the fusion op by
``take_single_rank``) or a plain tensor. A batch that does not qualify takes ``norm(h,
residual)``, today's path; each reason is logged once per process.

The residual: ``residual_out`` is a new tensor that receives ``h + residual`` when the pending
norm runs (by the launch, or by `PendingNorm.materialize`); the layer takes it as its residual at
once, so the pending norm must run before the residual is read (in a decoder layer the attention
runs it first thing). The launch writes neither ``h`` nor ``residual``; the separate norm writes
them where it always does (flashinfer's in-place kernel), then copies its sum into
``residual_out``.
"""
from __future__ import annotations

import logging
from typing import Optional, Union

import torch

from arfusion.fusion import PartialSum, norm
from arfusion.layers import batch_invariant
from arfusion.layers.kernels.triton_support import triton_available
from arfusion.layers.layernorm import NormInput, RMSNorm

logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()  # the reasons logged so far (a fixed handful of texts)


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.info("norm into q/k/v: %s; that layer input takes the separate norm", reason)


class PendingNorm:
    """``rms_norm(x + residual) * weight`` (``eps``), not yet computed, and ``residual_out``, the
    tensor that receives ``x + residual`` when it runs (module docstring). It runs once: by
    `linear` or `materialize`; a second run raises ValueError."""

    __slots__ = ("x", "residual", "weight", "eps", "residual_out")

    def __init__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual_out: torch.Tensor) -> None:
        self.x: Optional[torch.Tensor] = x
        self.residual = residual
        self.weight = weight
        self.eps = eps
        self.residual_out = residual_out

    def _take(self) -> torch.Tensor:
        x, self.x = self.x, None
        if x is None:
            raise ValueError("this pending norm already ran: it is consumed once")
        return x

    def linear(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``normed @ weight^T (+ bias)``, a new tensor: in one launch with the norm where
        `triton_norm_matmul.refusal` allows (the launch writes the sum into ``residual_out``),
        else `materialize`, then `batch_invariant.linear` (the projection's own matmul)."""
        x = self.x
        if x is None:
            raise ValueError("this pending norm already ran: it is consumed once")
        if triton_available():
            from arfusion.layers.kernels.triton_norm_matmul import norm_linear, refusal

            reason = refusal(x, self.residual, self.weight, weight, bias)
            if reason is None:
                self._take()
                return norm_linear(x, self.residual, self.weight, self.eps, weight, bias, self.residual_out)[0]
            _log_once(reason)
        return batch_invariant.linear(self.materialize(), weight, bias)

    def materialize(self) -> torch.Tensor:
        """The normed tensor by the separate norm (`fusion.norm.add_rms_norm`, what the layer's
        norm runs at TP1: flashinfer's in-place kernel on the GPU, `fusion.reference` elsewhere),
        its sum copied into ``residual_out``."""
        normed, summed = norm.add_rms_norm(self._take(), self.residual, self.weight, self.eps)
        self.residual_out.copy_(summed)
        return normed


AttentionInput = Union[torch.Tensor, PendingNorm]


def folds(requested: bool, world_size: int) -> bool:
    """Whether a layer folds its input norm into q/k/v: ``requested`` at TP size 1 (at a larger
    size the norm runs with the reduction, by the fusion op; logged once)."""
    if requested and world_size != 1:
        _log_once(f"TP size is {world_size}: the norm runs with its all-reduce")
    return requested and world_size == 1


def deferral_refusal(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why the batch ``x``, ``residual`` (norm weight ``weight``) takes the separate norm instead of a
    `PendingNorm`, or None (module docstring)."""
    if batch_invariant.enabled():
        return "batch-invariant mode keeps the row-invariant norm and matmul"
    if not triton_available():
        return "triton is not installed"
    from arfusion.layers.kernels.triton_norm_matmul import refusal

    return refusal(x, residual, weight)


def defer(norm_layer: RMSNorm, hidden_states: NormInput, residual: torch.Tensor) -> Optional[PendingNorm]:
    """``norm_layer(hidden_states, residual)`` as a `PendingNorm`, or None (nothing taken) when
    the batch does not qualify (`deferral_refusal`; a `PartialSum` whose op does not hand its
    sum over: TP size above 1, deterministic fusion)."""
    weight = norm_layer.weight
    partial = hidden_states if hidden_states.__class__ is PartialSum else None
    x = partial.pending if partial is not None else hidden_states
    reason = deferral_refusal(x, residual, weight) if x is not None else None
    if reason is not None:
        _log_once(reason)
        return None
    residual_out = torch.empty_like(residual)
    if partial is not None:
        x = partial.op.take_single_rank(partial, residual, residual_out)  # raises for a partial taken already
        if x is None:
            _log_once("the fusion op does not hand the sum over (TP size above 1 or deterministic fusion)")
            return None
    return PendingNorm(x, residual, weight, norm_layer.eps, residual_out)


def input_norm(norm_layer: RMSNorm, hidden_states: NormInput, residual: Optional[torch.Tensor],
               fold: bool) -> tuple[AttentionInput, torch.Tensor]:
    """A decoder layer's input norm: ``(normed or PendingNorm, residual)`` (module docstring);
    ``residual`` None (layer 0): ``(norm_layer(hidden_states), hidden_states)``."""
    if residual is None:
        return norm_layer(hidden_states), hidden_states
    if fold:
        pending = defer(norm_layer, hidden_states, residual)
        if pending is not None:
            return pending, pending.residual_out
    return norm_layer(hidden_states, residual)

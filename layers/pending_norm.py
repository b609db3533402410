"""A decoder layer's residual add + RMSNorm handed to the launch after it unrun, so that at TP1 a
decode batch's norm runs inside that launch: the input norm inside the q/k/v matmul (one launch
instead of the norm's and the matmul's: layers/kernels/triton_norm_matmul.py), and the
post-attention norm inside a MoE block's routing launch (layers/moe/kernels/triton_route_norm.py).

    input_norm(norm, h, residual, fold)  -> (normed, residual)         as ``norm(h, residual)``
                                         or (PendingNorm, residual_out) when ``fold`` and the
                                            batch qualifies (`defer`)
    QKVParallelLinear(pending)           -> pending.linear(W, b): the one launch, where it serves
                                            W; else the separate norm, then the matmul
    pending.materialize()                -> the normed tensor by the separate norm (any other
                                            consumer: a `PendingNorm` is not a tensor)

    post_attention_norm(norm, h, residual, refusal)
                                         -> as ``input_norm``, for a MoE block's routing launch
                                            (``refusal`` None: ``norm(h, residual)``)
    router.route_normed(pending, ...)    -> pending.run_in(launch, ...): the norm and the routing
                                            in one launch, where it serves; else ``materialize``,
                                            then the router's own routing (layers/moe/router.py)

A batch qualifies when the layer folds (``fold``: requested, and TP size 1: `folds`), it has a
residual (layer 0 normalises the embeddings alone, as before), batch-invariant mode is off, and
the launch takes it (`triton_norm_matmul.refusal`: CUDA fp16 / bf16, at most 32 tokens, hidden
size a multiple of 16). ``h`` is then the previous layer's `fusion.PartialSum` (a model defers
its MLP's reduction into this norm; at TP1 the sum is its own tensor, taken from the fusion op by
``take_single_rank``) or a plain tensor. A batch that does not qualify takes ``norm(h,
residual)``, today's path; each reason is logged once per process. The post-attention norm
qualifies alike, with ``h`` this layer's o_proj output (a `PartialSum`) and the routing launch's
limits (`triton_router.norm_refusal`: CUDA fp16 / bf16, a batch its one-launch path takes by
default: one token), where the layer folds it (a
``refusal`` given: requested, TP size 1, and a MoE block whose router runs that launch:
`TopKRouter.norm_deferral_refusal`).

The residual: ``residual_out`` is a new tensor that receives ``h + residual`` when the pending
norm runs (by the launch, or by `PendingNorm.materialize`); the layer takes it as its residual at
once, so the pending norm must run before the residual is read (in a decoder layer the attention,
or the MoE block's router, runs it first thing). The launch writes neither ``h`` nor
``residual``; the separate norm writes them where it always does (flashinfer's in-place kernel),
then copies its sum into ``residual_out``.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, TypeVar, Union

import torch

from arfusion.fusion import PartialSum, norm
from arfusion.layers import batch_invariant
from arfusion.layers.kernels.triton_support import triton_available
from arfusion.layers.layernorm import NormInput, RMSNorm

logger = logging.getLogger(__name__)
_LOGGED: set[tuple[str, str]] = set()  # the (launch, reason) pairs logged so far (a fixed handful)
QKV, ROUTING = "q/k/v", "routing"  # the launches a norm folds into (for the log)
Refusal = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Optional[str]]  # (x, residual, weight) -> why not
T = TypeVar("T")


def _log_once(reason: str, into: str = QKV) -> None:
    if (into, reason) not in _LOGGED:
        _LOGGED.add((into, reason))
        logger.info("norm into %s: %s; that norm runs on its own", into, reason)


class PendingNorm:
    """``rms_norm(x + residual) * weight`` (``eps``), not yet computed, and ``residual_out``, the
    tensor that receives ``x + residual`` when it runs (module docstring). It runs once: by
    `linear`, `run_in` or `materialize`; a second run raises ValueError."""

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
            from arfusion.layers.kernels.triton_norm_matmul import launch_checked, refusal

            reason = refusal(x, self.residual, self.weight, weight, bias)
            if reason is None:  # checked: the launch alone (residual_out is this norm's own new tensor)
                self._take()
                return launch_checked(x, self.residual, self.weight, self.eps, weight, bias, self.residual_out)
            _log_once(reason)
        return batch_invariant.linear(self.materialize(), weight, bias)

    def run_in(self, launch: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor], T],
               refusal: Refusal, into: str) -> Optional[T]:
        """``launch(x, residual, weight, eps, residual_out)``: a launch that runs this norm (and
        writes the sum into ``residual_out``), where ``refusal(x, residual, weight)`` is None;
        else None, nothing run (the reason logged once, for the launch ``into``): the caller
        then runs `materialize`."""
        x = self.x
        if x is None:
            raise ValueError("this pending norm already ran: it is consumed once")
        reason = refusal(x, self.residual, self.weight)
        if reason is not None:
            _log_once(reason, into)
            return None
        self._take()
        return launch(x, self.residual, self.weight, self.eps, self.residual_out)

    def materialize(self) -> torch.Tensor:
        """The normed tensor by the separate norm (`fusion.norm.add_rms_norm`, what the layer's
        norm runs at TP1: flashinfer's in-place kernel on the GPU, `fusion.reference` elsewhere),
        its sum copied into ``residual_out``."""
        normed, summed = norm.add_rms_norm(self._take(), self.residual, self.weight, self.eps)
        self.residual_out.copy_(summed)
        return normed


AttentionInput = Union[torch.Tensor, PendingNorm]
MlpInput = AttentionInput  # a MoE block's input: normed, or the post-attention norm pending


def folds(requested: bool, world_size: int, into: str = QKV) -> bool:
    """Whether a layer folds a norm into the launch ``into``: ``requested`` at TP size 1 (at a
    larger size the norm runs with the reduction, by the fusion op; logged once)."""
    if requested and world_size != 1:
        _log_once(f"TP size is {world_size}: the norm runs with its all-reduce", into)
    return requested and world_size == 1


def mode_refusal() -> Optional[str]:
    """Why no norm is left pending in this process now (batch-invariant mode, no triton), or None."""
    if batch_invariant.enabled():
        return "batch-invariant mode keeps today's row-invariant path"
    if not triton_available():
        return "triton is not installed"
    return None


def deferral_refusal(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
    """Why the batch ``x``, ``residual`` (norm weight ``weight``) takes the separate norm instead of a
    `PendingNorm` for q/k/v, or None (module docstring)."""
    reason = mode_refusal()
    if reason is not None:
        return reason
    from arfusion.layers.kernels.triton_norm_matmul import refusal

    return refusal(x, residual, weight)


def defer(norm_layer: RMSNorm, hidden_states: NormInput, residual: torch.Tensor, refusal: Refusal,
          into: str = QKV) -> Optional[PendingNorm]:
    """``norm_layer(hidden_states, residual)`` as a `PendingNorm` for the launch ``into``, or None
    (nothing taken) when the batch does not qualify (``refusal(x, residual, weight)``; a
    `PartialSum` whose op does not hand its sum over: TP size above 1, deterministic fusion)."""
    weight = norm_layer.weight
    partial = hidden_states if hidden_states.__class__ is PartialSum else None
    x = partial.formed() if partial is not None else hidden_states  # a sum not yet formed: formed here
    reason = refusal(x, residual, weight) if x is not None else None
    if reason is not None:
        _log_once(reason, into)
        return None
    residual_out = torch.empty_like(residual)
    if partial is not None:
        x = partial.op.take_single_rank(partial, residual, residual_out)  # raises for a partial taken already
        if x is None:
            _log_once("the fusion op does not hand the sum over (TP size above 1 or deterministic fusion)", into)
            return None
    return PendingNorm(x, residual, weight, norm_layer.eps, residual_out)


def input_norm(norm_layer: RMSNorm, hidden_states: NormInput, residual: Optional[torch.Tensor],
               fold: bool) -> tuple[AttentionInput, torch.Tensor]:
    """A decoder layer's input norm: ``(normed or PendingNorm, residual)`` (module docstring);
    ``residual`` None (layer 0): ``(norm_layer(hidden_states), hidden_states)``."""
    if residual is None:
        return norm_layer(hidden_states), hidden_states
    if fold:
        pending = defer(norm_layer, hidden_states, residual, deferral_refusal)
        if pending is not None:
            return pending, pending.residual_out
    return norm_layer(hidden_states, residual)


def post_attention_norm(norm_layer: RMSNorm, hidden_states: NormInput, residual: torch.Tensor,
                        refusal: Optional[Refusal]) -> tuple[MlpInput, torch.Tensor]:
    """A decoder layer's post-attention norm: ``(normed or PendingNorm, residual)``, the pending
    norm for the MoE block's routing launch where ``refusal`` (its router's
    `TopKRouter.norm_deferral_refusal`) lets the batch through (module docstring); ``refusal``
    None (the layer does not fold it: the flag off, TP size above 1, a dense MLP):
    ``norm_layer(h, residual)``."""
    if refusal is not None:
        pending = defer(norm_layer, hidden_states, residual, refusal, ROUTING)
        if pending is not None:
            return pending, pending.residual_out
    return norm_layer(hidden_states, residual)

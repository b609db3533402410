"""`run_routed_experts`: a MoE block's hand-off from its router to its experts, shared by every
block (`SparseMoeBlock`, `GptOssMoeBlock`).

    block_m              = experts.block_m(T, k)     rows per block of the experts' grouped launch,
                                                      None where they group nothing
    w, ids[, blocks]     = router(h[, block_m])       the routing launch groups the slots by expert
                                                      itself when block_m is given
    h_partial            = experts(h, w, ids, blocks)   or, asked by a MoE layer at TP1, the
                                                      sum left unformed for the next norm

Given the layer's norm left pending (`PendingNorm`), the routing launch runs that norm first
(`TopKRouter.route_normed`) and the experts take its output. Nothing is written in place beyond
what the router's and the experts' own docstrings say.
"""
from __future__ import annotations

from typing import Optional, Protocol, Union

import torch

from arfusion.fusion import UnformedSum
from arfusion.layers.moe.align import ExpertBlocks
from arfusion.layers.moe.router import TopKRouter
from arfusion.layers.pending_norm import MlpInput, PendingNorm


class GroupedExperts(Protocol):
    """Experts that say how they group their slots and take the groups made by the routing."""

    def block_m(self, tokens: int, top_k: int) -> Optional[int]: ...

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 blocks: Optional[ExpertBlocks] = None) -> torch.Tensor: ...


def experts_take_pdl(router: TopKRouter, experts: GroupedExperts, tokens: int) -> bool:
    """Whether a batch of ``tokens`` runs this block's launches with programmatic dependent launch
    when the switch is on (layers/kernels/pdl.py): the routing launch always takes part, the
    experts' matrix-vector launches (no grouping) too, their grouped launches not (a decode step
    with such a launch between its PDL kernels was measured slower: docs/results.md)."""
    return experts.block_m(tokens, router.top_k) is None


def run_routed_experts(router: TopKRouter, experts: GroupedExperts, hidden_states: MlpInput,
                       unformed: bool = False) -> Union[torch.Tensor, UnformedSum]:
    """``[T, hidden]`` (reduced, normed; or a `PendingNorm`) -> this rank's partial MoE output
    ``[T, hidden]`` (module docstring): the routing groups the slots by expert where the experts'
    launches group them, so that they skip their own grouping launch. ``unformed``: passed to
    the experts, which leave their output unformed where their launches can
    (`layers.moe.gpt_oss_moe.GptOssExperts`, `layers.moe.experts.MoEExperts`)."""
    extra = {"unformed": True} if unformed else {}
    if hidden_states.__class__ is PendingNorm:
        block_m = experts.block_m(hidden_states.residual.shape[0], router.top_k)
        normed, weights, ids, blocks = router.route_normed(hidden_states, block_m)
        return experts(normed, weights, ids, blocks, **extra)
    block_m = experts.block_m(hidden_states.shape[0], router.top_k)
    if block_m is None:
        return experts(hidden_states, *router(hidden_states), **extra)
    return experts(hidden_states, *router.route(hidden_states, block_m), **extra)

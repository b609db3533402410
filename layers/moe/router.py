"""The MoE router: which ``top_k`` of ``E`` experts each token goes to, and with what weight.

    logits  = h @ W_gate^T (+ b)                 fp32 accumulation of the products of h and W_gate
                                                 (both in the model's dtype), kept in fp32; the
                                                 bias b (gpt-oss's router has one) added in fp32
    probs   = softmax(logits)                    fp32, over all E experts
    ids     = the top_k largest logits           descending; equal logits: the lower expert first
    w       = probs[ids]                         ids: int32 [T, k], distinct per token
    w      /= sum(w)            (renormalize)    Mixtral always; Qwen3-MoE with norm_topk_prob

The tie rule is ours: ``torch.topk`` (as Hugging Face's routers call it) states none, and on the
CPU it returns tied experts in no index order. Softmax is monotone, so choosing by logits is
choosing by probabilities, without the ties that fp32 rounding of the probabilities can add.

The gate weight is replicated on every TP rank (``[E, hidden]``, small) and so is the routing:
every rank computes it from the same all-reduced ``h``, so all ranks pick the same experts.
On the GPU the routing runs in Triton (layers/moe/kernels/triton_router.py); this module's torch
code is its reference and the CPU path.

Batch-invariant mode (`layers.batch_invariant.enabled()`): a token's weights and ids must not
depend on the other tokens. The Triton routing is so in both modes (fixed tiles and split of the
hidden size, the partial logits added in split order, the softmax's sums over one layout at every
batch size: triton_router.py's docstring). The torch path takes, in this mode, the logits from
`batch_invariant.linear` (fp32) and the softmax's and the renormalisation's sums from
`batch_invariant.tree_sum`; the max, the sort and the gather are exact in any order.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from arfusion.layers import batch_invariant
from arfusion.layers.kernels.triton_support import triton_available
from arfusion.layers.linear import default_weight_loader
from arfusion.layers.moe.align import ExpertBlocks
from arfusion.layers.pending_norm import ROUTING, PendingNorm, mode_refusal


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(weights fp32 [T, top_k], ids int32 [T, top_k])`` by the module
    docstring's math (a stable descending sort gives the tie rule); the softmax and the
    selection run in fp32 whatever ``logits``' dtype; in batch-invariant mode the two sums by
    `batch_invariant.tree_sum`."""
    if not 0 < top_k <= logits.shape[-1]:
        raise ValueError(f"top_k must be in 1..{logits.shape[-1]} (the number of experts), got {top_k}")
    logits = logits.float()
    fixed = batch_invariant.enabled()
    if fixed:
        exp = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
        probs = exp / batch_invariant.tree_sum(exp).unsqueeze(-1)
    else:
        probs = torch.softmax(logits, dim=-1)
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(-1, ids)
    if renormalize:
        total = batch_invariant.tree_sum(weights) if fixed else weights.sum(dim=-1)
        weights = weights / total.unsqueeze(-1)
    return weights, ids.to(torch.int32)


def router_logits_torch(hidden_states: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``h [T, hidden]``, ``weight [E, hidden]``, optional ``bias [E]`` -> fp32 ``[T, E]``:
    products, sums and the bias's add in fp32 (the products of two bf16 / fp16 numbers are exact
    in fp32); `batch_invariant.linear`, so row-invariant in batch-invariant mode."""
    return batch_invariant.linear(hidden_states.float(), weight.float(), None if bias is None else bias.float())


class TopKRouter(nn.Module):
    """``forward(h [T, hidden]) -> (weights fp32 [T, top_k], ids int32 [T, top_k])``; the gate
    weight ``[num_experts, hidden]`` (in ``dtype``) and, with ``bias``, a bias ``[num_experts]``
    (in ``dtype``, added to the fp32 logits) are loaded whole on every rank.

    On a CUDA ``h`` with triton the routing is one Triton launch for a batch of
    `triton_router.ONE_LAUNCH_MAX_TOKENS` token (`route` also groups the slots by expert for the
    grouped GEMM in it), or of up to `triton_router.UNGROUPED_ONE_LAUNCH_MAX_TOKENS` where nothing
    is grouped, two for larger ones; ``_counter`` is the one launch's arrival counter
    (int32, zero between calls: the launch resets it)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None, bias: bool = False
                 ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.bias: Optional[nn.Parameter] = None
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype, device=device), requires_grad=False)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.register_buffer("_counter", torch.zeros(1, dtype=torch.int32, device=device), persistent=False)

    def _triton(self, hidden_states: torch.Tensor) -> bool:
        return hidden_states.is_cuda and triton_available()

    def route(self, hidden_states: torch.Tensor, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, Optional[ExpertBlocks]]:
        """``forward``'s ``(weights, ids)`` and, where one Triton launch does both, the slots
        grouped by expert in blocks of ``block_m`` rows (layers/moe/align.py); else None."""
        if self._triton(hidden_states):
            from arfusion.layers.moe.kernels.triton_router import route_triton

            return route_triton(hidden_states, self.weight, self.top_k, self.renormalize, self._counter, block_m,
                                self.bias)
        return (*self.forward(hidden_states), None)

    def norm_deferral_refusal(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
        """Why a decoder layer does not leave the norm of ``x + residual`` (``weight``) pending for
        this router (`layers.pending_norm.post_attention_norm`), or None: the process's mode
        (`pending_norm.mode_refusal`: batch-invariant mode, no triton), then `norm_launch_refusal`."""
        return mode_refusal() or self.norm_launch_refusal(x, residual, weight)

    def norm_launch_refusal(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> Optional[str]:
        """Why this router's Triton launch does not run that norm (`triton_router.norm_refusal`), or None."""
        if not triton_available():
            return "triton is not installed"
        from arfusion.layers.moe.kernels.triton_router import norm_refusal

        return norm_refusal(x, residual, weight, self.top_k)

    def route_normed(self, pending: PendingNorm, block_m: Optional[int]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[ExpertBlocks]]:
        """``(normed, weights, ids, blocks)`` of a decoder layer's norm left pending
        (`layers.pending_norm`): the norm inside this router's Triton launch (the launch of
        `route` with ``block_m``, of ``forward`` without; ``normed`` a new tensor) where
        `triton_router.norm_refusal` allows; else the norm materialized, then `route` (``block_m``
        given) or ``forward`` of it."""

        def launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[ExpertBlocks]]:
            from arfusion.layers.moe.kernels.triton_route_norm import RouteNorm
            from arfusion.layers.moe.kernels.triton_router import route_triton

            normed = torch.empty_like(x, memory_format=torch.contiguous_format)
            norm = RouteNorm(residual, weight, eps, normed, residual_out)
            return (normed, *route_triton(x, self.weight, self.top_k, self.renormalize, self._counter, block_m,
                                          self.bias, norm))

        routed = pending.run_in(launch, self.norm_launch_refusal, ROUTING)
        if routed is not None:
            return routed
        normed = pending.materialize()
        if block_m is None:
            return (normed, *self(normed), None)
        return (normed, *self.route(normed, block_m))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._triton(hidden_states):
            from arfusion.layers.moe.kernels.triton_router import route_triton

            weights, ids, _ = route_triton(hidden_states, self.weight, self.top_k, self.renormalize, self._counter,
                                           bias=self.bias)
            return weights, ids
        return select_experts(router_logits_torch(hidden_states, self.weight, self.bias), self.top_k,
                              self.renormalize)

"""The MoE router: which ``top_k`` of ``E`` experts each token goes to, and with what weight.

    logits  = h @ W_gate^T                       fp32 (h cast to fp32, W_gate kept in fp32)
    probs   = softmax(logits)                    fp32, over all E experts
    w, ids  = top_k(probs)                       ids: int32 [T, k], distinct per token
    w      /= sum(w)            (renormalize)    Mixtral always; Qwen3-MoE with norm_topk_prob

The gate weight is replicated on every TP rank (``[E, hidden]``, small) and so is the routing:
every rank computes it from the same all-reduced ``h``, so all ranks pick the same experts.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from layers.linear import default_weight_loader


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> ``(weights fp32 [T, top_k], ids int32 [T, top_k])`` by the module
    docstring's math; the softmax and the top-k run in fp32 whatever ``logits``' dtype."""
    if not 0 < top_k <= logits.shape[-1]:
        raise ValueError(f"top_k must be in 1..{logits.shape[-1]} (the number of experts), got {top_k}")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


class TopKRouter(nn.Module):
    """``forward(h [T, hidden]) -> (weights fp32 [T, top_k], ids int32 [T, top_k])``; the gate
    weight ``[num_experts, hidden]`` is an fp32 parameter loaded whole on every rank."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states.float(), self.weight)
        return select_experts(logits, self.top_k, self.renormalize)

"""`SparseMoeBlock`: the MLP of a MoE decoder layer (Qwen3-MoE's ``mlp``, Mixtral's
``block_sparse_moe``): a replicated `TopKRouter` and the TP-split `MoEExperts`.

    w, ids    = gate(h)                               fp32 routing, identical on every rank
    h_partial = experts(h, w, ids)                    this rank's partial sum, not reduced

On the GPU the routing launch also groups the slots by expert for the experts' grouped GEMM
(`TopKRouter.route`), so a decode step's MoE is three launches: routing, gate/up, down. Given the
layer's post-attention norm left pending (`layers.pending_norm.post_attention_norm`, at TP1 with
``norm_into_route``), the routing launch also runs that norm: ``h`` is its output.

The caller owes the all-reduce of ``h_partial`` (the decoder layer hands it to the next norm as
a `fusion.PartialSum`), as for a dense MLP's down projection with ``reduce_results=False``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from arfusion.fusion import UnformedSum
from arfusion.layers.moe.experts import MoEExperts
from arfusion.layers.moe.routed_experts import experts_take_pdl, run_routed_experts
from arfusion.layers.moe.router import TopKRouter
from arfusion.layers.pending_norm import MlpInput


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 dtype: Optional[torch.dtype] = None, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize, dtype, device)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size, dtype, device)

    def forward(self, hidden_states: MlpInput, unformed: bool = False) -> Union[torch.Tensor, UnformedSum]:
        """``[T, hidden]`` (reduced, normed; or the norm left pending, which the routing runs:
        `TopKRouter.route_normed`) -> this rank's partial MoE output ``[T, hidden]``; with
        ``unformed`` (at TP size 1) it may be left unformed for the norm after the layer
        (`MoEExperts.forward`)."""
        return run_routed_experts(self.gate, self.experts, hidden_states, unformed)

    def takes_pdl(self, tokens: int) -> bool:
        """`routed_experts.experts_take_pdl` of a batch of ``tokens``."""
        return experts_take_pdl(self.gate, self.experts, tokens)

"""Mixture-of-experts layers: routing, the TP-split experts and their torch and Triton paths."""
from arfusion.layers.moe.experts import MoEExperts
from arfusion.layers.moe.router import TopKRouter, select_experts
from arfusion.layers.moe.sparse_moe_block import SparseMoeBlock
from arfusion.layers.moe.torch_experts import combine_topk, expert_outputs, moe_experts_torch

__all__ = [
    "MoEExperts",
    "SparseMoeBlock",
    "TopKRouter",
    "combine_topk",
    "expert_outputs",
    "moe_experts_torch",
    "select_experts",
]

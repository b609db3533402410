"""Mixture-of-experts layers: routing, the TP-split experts and their torch and Triton paths."""
from layers.moe.experts import MoEExperts
from layers.moe.router import TopKRouter, select_experts
from layers.moe.sparse_moe_block import SparseMoeBlock
from layers.moe.torch_experts import combine_topk, expert_outputs, moe_experts_torch

__all__ = [
    "MoEExperts",
    "SparseMoeBlock",
    "TopKRouter",
    "combine_topk",
    "expert_outputs",
    "moe_experts_torch",
    "select_experts",
]

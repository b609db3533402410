"""Qwen3 (dense) and Qwen3-MoE on the block decoder (engine/models/block_decoder.py).

Qwen3's attention is Llama's with an RMSNorm over each head's ``head_dim`` features of q and k
(weights ``q_norm``, ``k_norm`` of shape ``[head_dim]``, shared by all heads), after the
projection and before the rotary embedding:

    q_h = rms_norm(q_h) * q_norm,  k_h = rms_norm(k_h) * k_norm     per head h, fp32 statistics

The norms run inside the rotary embedding's call that writes the KV cache (`head_norm` hands a
`layers.head_norm.HeadNorm` to layers/rotary_attention.py: on GPU one Triton launch norms, rotates
and stores, or with ``--rotary-into-attention`` a decode batch's attention launch does).
``q_norm``/``k_norm`` are `RMSNorm` modules for their weights (and checkpoint names) only.

Qwen3-MoE replaces every layer's MLP by a `SparseMoeBlock`: ``num_experts`` experts, top
``num_experts_per_tok``, the routing weights renormalized when ``norm_topk_prob``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from arfusion.engine.models.block_decoder import sparse_moe_block
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.hf_layouts import block_decoder_weight_shapes
from arfusion.engine.models.llama import LlamaAttention, LlamaForCausalLM
from arfusion.layers.head_norm import HeadNorm
from arfusion.layers.layernorm import RMSNorm


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: Optional[torch.device]) -> None:
        super().__init__(config, layer_id, dtype, device)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def head_norm(self) -> HeadNorm:
        return HeadNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention
    hf_weight_shapes = staticmethod(functools.partial(block_decoder_weight_shapes, qk_norm=True))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    make_mlp = staticmethod(sparse_moe_block)

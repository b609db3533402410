"""Qwen3 (dense) and Qwen3-MoE on the block decoder (engine/models/block_decoder.py).

Qwen3's attention is Llama's with an RMSNorm over each head's ``head_dim`` features of q and k
(weights ``q_norm``, ``k_norm`` of shape ``[head_dim]``, shared by all heads), after the
projection and before the rotary embedding:

    q_h = rms_norm(q_h) * q_norm,  k_h = rms_norm(k_h) * k_norm     per head h, fp32 statistics

The norms run inside the rotary embedding's call that writes the KV cache
(`RotaryEmbedding.forward_store_kv` with a `layers.head_norm.HeadNorm`: on GPU one Triton launch
norms, rotates and stores). ``q_norm``/``k_norm`` are `RMSNorm` modules for their weights (and
checkpoint names) only.

Qwen3-MoE replaces every layer's MLP by a `SparseMoeBlock`: ``num_experts`` experts, top
``num_experts_per_tok``, the routing weights renormalized when ``norm_topk_prob``.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from arfusion.engine.models.block_decoder import sparse_moe_block
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.forward_batch import ForwardBatch, KVCache
from arfusion.engine.models.hf_layouts import block_decoder_weight_shapes
from arfusion.engine.models.llama import LlamaAttention, LlamaForCausalLM
from arfusion.layers.head_norm import HeadNorm
from arfusion.layers.layernorm import RMSNorm
from arfusion.layers.pending_norm import AttentionInput


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: Optional[torch.device]) -> None:
        super().__init__(config, layer_id, dtype, device)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, hidden_states: AttentionInput, batch: ForwardBatch,
                kv_cache: KVCache) -> torch.Tensor:
        """``[T, hidden]`` (reduced, normed; or the norm left pending, which qkv_proj runs) -> this
        rank's partial o_proj output ``[T, hidden]``."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        k_cache, v_cache = kv_cache.k[self.layer_id], kv_cache.v[self.layer_id]
        head_norm = HeadNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q = self.rotary_emb.forward_store_kv(positions, q, k, v, batch.slot_mapping, k_cache, v_cache, head_norm)
        return self.o_proj(self.attn.attend(q, k_cache, v_cache, batch))


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention
    hf_weight_shapes = staticmethod(functools.partial(block_decoder_weight_shapes, qk_norm=True))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    make_mlp = staticmethod(sparse_moe_block)

"""The Llama family on the block decoder (engine/models/block_decoder.py, whose docstring has a
layer's data flow and its reductions): LlamaForCausalLM, Qwen2ForCausalLM (q/k/v bias) and
MistralForCausalLM share it. Its attention block (qkv_proj -> rope + KV-cache write -> attention
-> o_proj with ``reduce_results=False``) and dense MLP (gate_up_proj -> SiLU * up -> down_proj with
``reduce_results=False``) are the base the other decoders extend."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from arfusion.engine.models.block_decoder import BlockDecoderForCausalLM
from arfusion.engine.models.config import ModelConfig
from arfusion.engine.models.forward_batch import ForwardBatch, KVCache
from arfusion.engine.models.hf_layouts import block_decoder_param_target, llama_weight_shapes, o_proj_has_bias
from arfusion.layers.activation import SiluAndMul
from arfusion.layers.attention import Attention
from arfusion.layers.head_norm import HeadNorm
from arfusion.layers.kernels.l2_prefetch import ahead
from arfusion.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from arfusion.layers.pending_norm import AttentionInput
from arfusion.layers.rotary_attention import rotate_store_attend
from arfusion.layers.rotary_embedding import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, device: Optional[torch.device]) -> None:
        super().__init__()
        d = config.head_dim
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(config.hidden_size, d, config.num_attention_heads, config.num_key_value_heads,
                                          bias=config.attention_bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size, bias=o_proj_has_bias(config),
                                        reduce_results=False, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(d, config.rope_theta, config.rope_scaling, device=device)
        self.attn = self.make_attention(config, layer_id, device)
        self.rotary_into_attention = config.rotary_into_attention
        self.prefetch_o_proj_max_batch = config.prefetch_o_proj_max_batch

    def make_attention(self, config: ModelConfig, layer_id: int, device: Optional[torch.device]) -> Attention:
        """This rank's heads attending with softmax scale ``head_dim ** -0.5``."""
        d = config.head_dim
        return Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, d, d ** -0.5)

    def forward(self, positions: torch.Tensor, hidden_states: AttentionInput, batch: ForwardBatch,
                kv_cache: KVCache) -> torch.Tensor:
        """``[T, hidden]`` (reduced, normed; or the norm left pending, which qkv_proj runs) -> this
        rank's partial o_proj output ``[T, hidden]``. A decode batch of at most
        ``prefetch_o_proj_max_batch`` sequences has the o_proj weight prefetched into L2 beside the
        rotary and attention launches (layers/kernels/l2_prefetch.py ``ahead``)."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        if not (batch.is_decode and batch.batch_size <= self.prefetch_o_proj_max_batch):
            return self.o_proj(self._attend(positions, q, k, v, batch, kv_cache))
        with ahead(self.o_proj.weight):
            out = self._attend(positions, q, k, v, batch, kv_cache)
        return self.o_proj(out)  # after the prefetch's launch (the block's exit joins it)

    def _attend(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                kv_cache: KVCache) -> torch.Tensor:
        """Rotary, the KV-cache write and the attention of this layer (`rotate_store_attend`)."""
        k_cache, v_cache = kv_cache.k[self.layer_id], kv_cache.v[self.layer_id]
        return rotate_store_attend(self.attn, self.rotary_emb, positions, q, k, v, k_cache, v_cache, batch,
                                   self.head_norm(), self.rotary_into_attention)

    def head_norm(self) -> Optional[HeadNorm]:
        """The per-head q/k norm the rotary step applies first (None: none; Qwen3 has one)."""
        return None


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: Optional[torch.device]) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter, inter], dtype=dtype, device=device)
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, config.hidden_size, reduce_results=False, dtype=dtype, device=device)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, hidden] -> `` this rank's partial down_proj output ``[T, hidden]``."""
        return self.down_proj(self.act_fn(self.gate_up_proj(hidden_states)))


class LlamaForCausalLM(BlockDecoderForCausalLM):
    attention_class = LlamaAttention
    make_mlp = LlamaMLP
    hf_weight_shapes = staticmethod(llama_weight_shapes)
    param_target = staticmethod(block_decoder_param_target)

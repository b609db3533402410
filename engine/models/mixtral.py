"""Mixtral on the block decoder (engine/models/block_decoder.py): Llama's attention and, in every
layer, a `SparseMoeBlock` of ``num_experts`` experts (8 for Mixtral-8x7B), top
``num_experts_per_tok`` (2), the routing weights always renormalized over the chosen experts (HF
Mixtral's softmax over all experts, then top-k, then division by the top-k sum)."""
from __future__ import annotations

from engine.models.block_decoder import BlockDecoderForCausalLM, sparse_moe_block
from engine.models.config import ModelConfig
from engine.models.hf_layouts import Shapes, block_decoder_param_target, block_decoder_weight_shapes
from engine.models.llama import LlamaAttention


def mixtral_weight_shapes(config: ModelConfig) -> Shapes:
    return block_decoder_weight_shapes(config, qk_norm=False)


class MixtralForCausalLM(BlockDecoderForCausalLM):
    attention_class = LlamaAttention
    make_mlp = staticmethod(sparse_moe_block)
    hf_weight_shapes = staticmethod(mixtral_weight_shapes)
    param_target = staticmethod(block_decoder_param_target)

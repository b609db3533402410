"""Mixtral on the block decoder (engine/models/block_decoder.py): Llama's attention and, in every
layer, a `SparseMoeBlock` of ``num_experts`` experts (8 for Mixtral-8x7B), top
``num_experts_per_tok`` (2), the routing weights always renormalized over the chosen experts (HF
Mixtral's softmax over all experts, then top-k, then division by the top-k sum)."""
from __future__ import annotations

import functools

from arfusion.engine.models.block_decoder import sparse_moe_block
from arfusion.engine.models.hf_layouts import block_decoder_weight_shapes
from arfusion.engine.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    make_mlp = staticmethod(sparse_moe_block)
    hf_weight_shapes = staticmethod(functools.partial(block_decoder_weight_shapes, qk_norm=False))

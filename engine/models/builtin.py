"""Built-in model configs, selected by name instead of a checkpoint directory.

    tiny          the project's embedded default: a 4-layer Llama over the tiny byte-level
                  tokenizer (264 ids), run with dummy weights; heads (8), KV heads (4),
                  intermediate (512) and vocab divide TP 1, 2 and 4 (and 8, KV heads replicated)
    llama3-8b     Llama-3.1-8B's shapes (llama3 rope scaling, 128k context)
    qwen2.5-0.5b  Qwen2.5-0.5B's shapes (q/k/v bias, tied embeddings)
    tiny-moe      the MoE counterpart of tiny: a 4-layer Qwen3-MoE (q/k norm) of hidden 256 with
                  8 experts of intermediate 128, top-2 renormalized; experts split over TP 1, 2, 4
    qwen3-30b-a3b Qwen3-30B-A3B's shapes (48 layers, 128 experts of 768, top-8, head_dim 128)
    mixtral-8x7b  Mixtral-8x7B's shapes (32 layers, 8 experts of 14336, top-2)
    gpt-oss-20b   gpt-oss-20b's shapes (24 layers, hidden 2880, 64 heads x 64 and 8 KV heads,
                  sliding window 128 on every other layer, YaRN, 32 experts of 2880, top-4), its
                  experts in MXFP4 (kept, or dequantized at load: --mxfp4-experts)
    gpt-oss-120b  gpt-oss-120b's shapes (36 layers, 128 experts): about 65 GB with MXFP4 experts
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from arfusion.engine.models.config import ModelConfig


# the tiny byte-level tokenizer's (`engine.tokenizers.tokenizer.build_tiny_tokenizer`): 256 bytes,
# then its 8 special tokens, <|begin_of_text|> first; <|end_of_text|> and <|im_end|> stop
TINY_VOCAB_SIZE, TINY_BOS_ID, TINY_EOS_IDS = 264, 256, (257, 259)


def tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=TINY_VOCAB_SIZE,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        bos_token_id=TINY_BOS_ID,
        eos_token_ids=TINY_EOS_IDS,
    )


LLAMA3_8B = ModelConfig(
    architecture="LlamaForCausalLM",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    max_position_embeddings=131072,
    bos_token_id=128000,
    eos_token_ids=(128001, 128009),
)

QWEN2_5_0_5B = ModelConfig(
    architecture="Qwen2ForCausalLM",
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    attention_bias=True,
    bos_token_id=151643,
    eos_token_ids=(151643, 151645),
)

QWEN3_30B_A3B = ModelConfig(
    architecture="Qwen3MoeForCausalLM",
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=151936,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_ids=(151643, 151645),
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
)

MIXTRAL_8X7B = ModelConfig(
    architecture="MixtralForCausalLM",
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=32000,
    rms_norm_eps=1e-5,
    rope_theta=1000000.0,
    max_position_embeddings=32768,
    bos_token_id=1,
    eos_token_ids=(2,),
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=14336,
    norm_topk_prob=True,
)


GPT_OSS_20B = ModelConfig(
    architecture="GptOssForCausalLM",
    hidden_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=2880,
    vocab_size=201088,
    rms_norm_eps=1e-5,
    rope_theta=150000.0,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096},
    max_position_embeddings=131072,
    attention_bias=True,
    bos_token_id=199998,
    eos_token_ids=(200002, 199999, 200012),
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=2880,
    sliding_window=128,
    layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)),
    expert_format="mxfp4",
)

GPT_OSS_120B = dataclasses.replace(
    GPT_OSS_20B, num_hidden_layers=36, num_experts=128,
    layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(36)),
)


def tiny_moe_config() -> ModelConfig:
    """The tiny model with Qwen3-MoE's blocks: 8 experts of intermediate 128, top 2."""
    return dataclasses.replace(tiny_config(), architecture="Qwen3MoeForCausalLM", rms_norm_eps=1e-6, num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True)


_BUILTIN: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny_config,
    "llama3-8b": lambda: LLAMA3_8B,
    "qwen2.5-0.5b": lambda: QWEN2_5_0_5B,
    "tiny-moe": tiny_moe_config,
    "qwen3-30b-a3b": lambda: QWEN3_30B_A3B,
    "mixtral-8x7b": lambda: MIXTRAL_8X7B,
    "gpt-oss-20b": lambda: GPT_OSS_20B,
    "gpt-oss-120b": lambda: GPT_OSS_120B,
}
BUILTIN_MODELS = tuple(_BUILTIN)


def builtin_config(name: str) -> ModelConfig:
    """The config of a built-in model; ValueError listing the names for an unknown one."""
    if name not in _BUILTIN:
        raise ValueError(f"unknown built-in model {name!r}; built-in models: {BUILTIN_MODELS}")
    return _BUILTIN[name]()

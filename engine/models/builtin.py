"""Built-in model configs, selected by name instead of a checkpoint directory.

    tiny          the project's embedded default: a 4-layer Llama over the tiny byte-level
                  tokenizer (264 ids), run with dummy weights; heads (8), KV heads (4),
                  intermediate (512) and vocab divide TP 1, 2 and 4 (and 8, KV heads replicated)
    llama3-8b     Llama-3.1-8B's shapes (llama3 rope scaling, 128k context)
    qwen2.5-0.5b  Qwen2.5-0.5B's shapes (q/k/v bias, tied embeddings)
"""
from __future__ import annotations

from engine.models.config import ModelConfig
from engine.tokenizers.tokenizer import build_tiny_tokenizer


def tiny_config() -> ModelConfig:
    tokenizer = build_tiny_tokenizer()
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=tokenizer.vocab_size,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
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

BUILTIN_MODELS = ("tiny", "llama3-8b", "qwen2.5-0.5b")


def builtin_config(name: str) -> ModelConfig:
    """The config of a built-in model; ValueError listing the names for an unknown one."""
    if name == "tiny":
        return tiny_config()
    if name == "llama3-8b":
        return LLAMA3_8B
    if name == "qwen2.5-0.5b":
        return QWEN2_5_0_5B
    raise ValueError(f"unknown built-in model {name!r}; built-in models: {BUILTIN_MODELS}")

"""GGUF -> HF mapping: tensor names, and metadata keys to a `ModelConfig`.

Names and keys come from the ``gguf`` package's constants (``TENSOR_NAMES``, ``Keys``), so they
follow llama.cpp's spelling. Only the dense Llama-family architectures are mapped:
``general.architecture`` ``llama`` -> ``LlamaForCausalLM`` (Mistral GGUFs use ``llama`` too) and
``qwen2`` -> ``Qwen2ForCausalLM``.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Optional

import numpy as np
from gguf import GGUFReader, Keys, MODEL_TENSOR, TENSOR_NAMES

from arfusion.engine.models.config import ModelConfig
from arfusion.engine.weights.errors import ModelFileError
from arfusion.engine.weights.gguf_moe_names import GGUF_MOE_ARCHITECTURES, moe_config_fields

GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# Architectures whose Q/K weights llama.cpp's converter permuted for its interleaved rope layout.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

# GGUF tensor base name -> HF name; ``{bid}`` is the layer index. A ".weight"/".bias" suffix carries over.
_GLOBAL_TENSORS: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
    MODEL_TENSOR.OUTPUT_NORM: "model.norm",
    MODEL_TENSOR.OUTPUT: "lm_head",
}
_BLOCK_TENSORS: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.ATTN_NORM: "input_layernorm",
    MODEL_TENSOR.ATTN_Q: "self_attn.q_proj",
    MODEL_TENSOR.ATTN_K: "self_attn.k_proj",
    MODEL_TENSOR.ATTN_V: "self_attn.v_proj",
    MODEL_TENSOR.ATTN_OUT: "self_attn.o_proj",
    MODEL_TENSOR.FFN_NORM: "post_attention_layernorm",
    MODEL_TENSOR.FFN_GATE: "mlp.gate_proj",
    MODEL_TENSOR.FFN_UP: "mlp.up_proj",
    MODEL_TENSOR.FFN_DOWN: "mlp.down_proj",
}
# Present in some files, carrying no weight the HF model has: rope_freqs is read into the config
# (`rope_scaling_from_freq_factors`); attn_rot_embd is a legacy, unused rotary table.
ROPE_FREQS_NAME = TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight"
_NOT_WEIGHTS = re.compile(
    rf"^({re.escape(ROPE_FREQS_NAME)}|blk\.\d+\.{TENSOR_NAMES[MODEL_TENSOR.ATTN_ROT_EMBD].split('.', 2)[2]}\.weight)$"
)

# Token texts that end generation whatever the eos id says: llama.cpp's end-of-generation list
# (llama-vocab.cpp). A chat model's GGUF names one eos, often its end-of-turn token, while the model
# also ends plain completions with its end-of-text token: Qwen2.5 instruct files say eos
# <|im_end|>, and HF's generation_config stops on <|endoftext|> as well.
END_OF_GENERATION_TOKENS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>"}
)

_NAME_TABLE: dict[str, str] = {TENSOR_NAMES[k]: v for k, v in _GLOBAL_TENSORS.items()}
_BLOCK_PATTERN = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BLOCK_TABLE: dict[str, str] = {TENSOR_NAMES[k].split(".", 2)[2]: v for k, v in _BLOCK_TENSORS.items()}


def hf_tensor_name(gguf_name: str) -> Optional[str]:
    """The HF name of a GGUF tensor; None for tensors that are not model weights (rope_freqs).

    Raises ValueError for a name this mapping does not know, so that no weight is dropped silently.
    """
    if _NOT_WEIGHTS.match(gguf_name):
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _NAME_TABLE and suffix in ("weight", "bias"):
        return f"{_NAME_TABLE[base]}.{suffix}"
    m = _BLOCK_PATTERN.match(gguf_name)
    if m and m.group(2) in _BLOCK_TABLE:
        return f"model.layers.{m.group(1)}.{_BLOCK_TABLE[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}: not part of a dense llama/qwen2 model")


class MissingMetadataError(ModelFileError):
    """A required GGUF metadata key is absent; the message names the file and the key."""


def field_value(reader: GGUFReader, key: str, default: Any = ..., path: str = "") -> Any:
    """The value of metadata ``key`` (scalar, string, or list for arrays).

    Raises `MissingMetadataError` naming ``path`` and the key when it is absent and no default is given.
    """
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise MissingMetadataError(path, f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def gguf_architecture(reader: GGUFReader, path: str = "") -> str:
    """``general.architecture``, checked against the supported ones (`ModelFileError` naming ``path``)."""
    arch = field_value(reader, Keys.General.ARCHITECTURE, path=path)
    supported = sorted(GGUF_ARCHITECTURES.keys() | GGUF_MOE_ARCHITECTURES.keys())
    if arch not in supported:
        raise ModelFileError(path, f"unknown GGUF architecture {arch!r}; supported: {supported}")
    return arch


def _rope_scaling_from_metadata(get: Callable[..., Any]) -> Optional[dict[str, Any]]:
    """``{arch}.rope.scaling.*`` -> a HF ``rope_scaling`` dict (None when absent or "none").

    ``get(key_template, default=...)`` reads one key of this file's architecture.
    """
    kind = get(Keys.Rope.SCALING_TYPE, None)
    if kind is None or kind == "none":
        return None
    factor = get(Keys.Rope.SCALING_FACTOR)
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        optional = {
            Keys.Rope.SCALING_ORIG_CTX_LEN: "original_max_position_embeddings",
            Keys.Rope.SCALING_ATTN_FACTOR: "attention_factor",
            Keys.Rope.SCALING_YARN_BETA_FAST: "beta_fast",
            Keys.Rope.SCALING_YARN_BETA_SLOW: "beta_slow",
        }
        for key, hf_key in optional.items():
            value = get(key, None)
            if value is not None:
                scaling[hf_key] = value
        return scaling
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r} (supported: none, linear, yarn)")


def rope_scaling_from_freq_factors(
    factors: np.ndarray, rope_theta: float, head_dim: int, original_context: int = 8192
) -> Optional[dict[str, Any]]:
    """Recover HF's ``llama3`` rope scaling from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores per-frequency divisors f_i (inv_freq_i / f_i is used), written from HF's
    llama3 rule with wavelength w_i = 2*pi / inv_freq_i, L = original context:
    f_i = 1 for w_i < L/hi, f_i = F for w_i > L/lo, else 1/f_i = (1 - s_i)/F + s_i with
    s_i = (L/w_i - lo)/(hi - lo). Only lo/L and hi/L are determined, so L is taken as given
    (``rope.scaling.original_context_length`` when the file has it, else Llama 3's 8192) and
    lo, hi are fitted from the smoothed f_i (at least two needed). The fit is checked by
    recomputing every f_i; a mismatch raises ValueError instead of loading a wrong rope.
    """
    factors = np.asarray(factors, dtype=np.float64)
    if np.allclose(factors, 1.0, rtol=0, atol=1e-6):
        return None
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if factors.shape != inv_freq.shape:
        raise ValueError(f"rope_freqs has {factors.size} entries, expected head_dim/2 = {inv_freq.size}")
    big = float(factors.max())
    smooth = (factors > 1 + 1e-5) & (factors < big * (1 - 1e-5))
    if smooth.sum() < 2:
        raise ValueError("rope_freqs: fewer than two smoothed frequencies; cannot recover llama3 rope scaling")
    s = (1.0 / factors[smooth] - 1.0 / big) / (1.0 - 1.0 / big)
    u = inv_freq[smooth] / (2 * math.pi)  # 1 / wavelength
    slope, intercept = np.polyfit(u, s, 1)  # s = slope * u + intercept = (L*u - lo) / (hi - lo)
    span = original_context / slope
    low = -intercept * span
    scaling = {
        "rope_type": "llama3",
        "factor": big,
        "low_freq_factor": round(float(low), 6),
        "high_freq_factor": round(float(low + span), 6),
        "original_max_position_embeddings": int(original_context),
    }
    if not np.allclose(llama3_freq_factors(scaling, rope_theta, head_dim), factors, rtol=1e-4, atol=0):
        raise ValueError("rope_freqs does not follow the llama3 rope scaling rule; cannot map it to HF rope_scaling")
    return scaling


def llama3_freq_factors(scaling: dict[str, Any], rope_theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors f_i of HF's llama3 rope scaling (see `rope_scaling_from_freq_factors`)."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    big, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    s = np.clip((context / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - s) / big + s)


def eos_token_ids(reader: GGUFReader) -> tuple[int, ...]:
    """The ids that end generation, deduplicated, in this order: the metadata's eos, end-of-turn
    and end-of-message ids, then (by id) every token whose text is in `END_OF_GENERATION_TOKENS`."""
    keys = (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
    ids = [int(i) for i in (field_value(reader, k, None) for k in keys) if i is not None]
    tokens = field_value(reader, Keys.Tokenizer.LIST, [])
    ids += [i for i, text in enumerate(tokens) if text in END_OF_GENERATION_TOKENS]
    return tuple(dict.fromkeys(ids))


def config_from_gguf(
    reader: GGUFReader, tensor_names: set[str], path: str = "", rope_freqs: Optional[np.ndarray] = None
) -> ModelConfig:
    """The `ModelConfig` of a GGUF file from its metadata (``reader``: the first shard) and the
    names of all its tensors (every shard).

    ``rope_freqs``: the dequantized ``rope_freqs.weight`` tensor when the file has one.
    Tied embeddings when there is no ``output.weight``; attention bias when ``blk.0.attn_q.bias`` exists.
    """
    arch = gguf_architecture(reader, path)

    def get(key: str, default: Any = ...) -> Any:
        return field_value(reader, key.format(arch=arch), default, path)

    heads = int(get(Keys.Attention.HEAD_COUNT))
    hidden = int(get(Keys.LLM.EMBEDDING_LENGTH))
    if heads <= 0:
        raise ValueError(f"{Keys.Attention.HEAD_COUNT.format(arch=arch)} must be positive, not {heads}")
    head_dim = int(get(Keys.Attention.KEY_LENGTH, hidden // heads))
    value_dim = int(get(Keys.Attention.VALUE_LENGTH, head_dim))
    rope_dim = int(get(Keys.Rope.DIMENSION_COUNT, head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"unsupported GGUF attention shape: key_length {head_dim}, value_length {value_dim}, "
            f"rope.dimension_count {rope_dim} must all be equal"
        )
    tokens = reader.get_field(Keys.Tokenizer.LIST)
    vocab = get(Keys.LLM.VOCAB_SIZE, len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise MissingMetadataError(path, f"GGUF metadata key {Keys.Tokenizer.LIST!r} is missing (needed for the vocab size)")
    rope_theta = float(get(Keys.Rope.FREQ_BASE, 10000.0))
    rope_scaling = _rope_scaling_from_metadata(get)
    if rope_freqs is not None:
        if rope_scaling is not None:
            raise ValueError("both rope_freqs and rope.scaling metadata; ambiguous rope scaling")
        original = int(get(Keys.Rope.SCALING_ORIG_CTX_LEN, 8192))
        rope_scaling = rope_scaling_from_freq_factors(rope_freqs, rope_theta, head_dim, original)
    moe = moe_config_fields(get, arch)  # the MoE / Qwen3 fields, architecture included, or {}
    return ModelConfig(
        architecture=moe.pop("architecture", GGUF_ARCHITECTURES.get(arch)),
        hidden_size=hidden,
        num_hidden_layers=int(get(Keys.LLM.BLOCK_COUNT)),
        num_attention_heads=heads,
        num_key_value_heads=int(get(Keys.Attention.HEAD_COUNT_KV, heads)),
        intermediate_size=int(get(Keys.LLM.FEED_FORWARD_LENGTH, moe.get("moe_intermediate_size", ...))),
        vocab_size=int(vocab),
        rms_norm_eps=float(get(Keys.Attention.LAYERNORM_RMS_EPS)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get(Keys.LLM.CONTEXT_LENGTH)),
        tie_word_embeddings=TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" not in tensor_names,
        attention_bias=TENSOR_NAMES[MODEL_TENSOR.ATTN_Q].format(bid=0) + ".bias" in tensor_names,
        head_dim=head_dim,
        bos_token_id=get(Keys.Tokenizer.BOS_ID, None),
        eos_token_ids=eos_token_ids(reader),
        **moe,
    )

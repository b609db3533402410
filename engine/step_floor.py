"""The memory floor of a decode step: the bytes one TP rank must read from HBM per step, over
the GPU's bandwidth. For `engine.bench_one_batch`, beside the measured TPOT.

    bytes = sum of the rank's parameters' bytes, except
              the input embeddings (a step reads B rows of them: counted as B rows) and
              the experts of a MoE layer: E * (1 - (1 - k/E)^B) of its E experts are read, the
              expected number that B tokens of k experts each hit when routing is uniform
              (dummy weights route about so); MXFP4 experts count their bytes as stored
          + the KV cache a step attends to: per layer B * min(context, window) slots of K and V
    floor_ms = bytes / HBM_BYTES_PER_S

A lower bound for a bandwidth-bound step: it ignores activations, the logits and every launch.
"""
from __future__ import annotations

from typing import Any

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e


def decode_step_bytes(model: Any, batch: int, context: int) -> int:
    """The bytes this rank reads in one decode step of ``batch`` sequences of ``context`` tokens
    (module docstring). ``model``: a `BlockDecoderForCausalLM` of this rank."""
    config = model.config
    total = 0.0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight") and not config.tie_word_embeddings:
            size = batch * p.shape[1] * p.element_size()
        elif ".experts." in name and config.num_experts:
            e, k = config.num_experts, config.num_experts_per_tok
            size *= 1 - (1 - k / e) ** batch
        total += size
    kv_heads = model.num_kv_heads_local
    for layer in range(config.num_hidden_layers):
        window = config.window_of(layer) or context
        total += batch * min(context, window) * 2 * kv_heads * config.head_dim * model.dtype.itemsize
    return int(total)


def floor_ms(step_bytes: int) -> float:
    """``step_bytes`` at `HBM_BYTES_PER_S`, in ms."""
    return step_bytes / HBM_BYTES_PER_S * 1e3

"""Per-head RMSNorm of q and k (Qwen3's ``q_norm``/``k_norm``), applied before the rotary embedding.

For every head x of head_dim d of q (of k), with w = q_weight (k_weight), shared by all heads:

    normed = round(x / sqrt(mean(x**2) + eps) * w)      fp32 statistics and products,
                                                        one rounding to x's dtype

`RotaryEmbedding.forward_store_kv` (layers/rotary_embedding.py) takes a `HeadNorm`: its torch
path norms the heads by `layers.layernorm.rms_norm_heads`, its GPU path in the rotary kernel that
writes the KV cache (layers/kernels/triton_rotary.py). This module imports nothing of the
layers, so that the kernels can name the type.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class HeadNorm(NamedTuple):
    """The weights ``[head_dim]`` of q's and k's per-head RMSNorm and their shared eps."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float

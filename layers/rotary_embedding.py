"""Rotary position embedding, NeoX (half-split) style, as Llama, Qwen2 and Mistral use.

For a head vector x of size d (the rotary dim) at position p, with x1 = x[:d/2], x2 = x[d/2:]
and angle_i = p * inv_freq_i, inv_freq_i = theta ** (-2i / d):

    out[:d/2] = x1 * cos(angle) - x2 * sin(angle)
    out[d/2:] = x2 * cos(angle) + x1 * sin(angle)

Llama-3 scaling (``rope_scaling = {"rope_type": "llama3", "factor", "low_freq_factor",
"high_freq_factor", "original_max_position_embeddings"}``) rescales inv_freq by wavelength
(wavelen = 2*pi / inv_freq, L = original_max_position_embeddings):

    wavelen < L / high_freq_factor   keep inv_freq
    wavelen > L / low_freq_factor    inv_freq / factor
    otherwise                        (1 - s) * inv_freq / factor + s * inv_freq,
                                     s = (L / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)

YaRN (``rope_type "yarn"``: ``factor`` s, ``original_max_position_embeddings`` L, ``beta_fast``
(32), ``beta_slow`` (1), ``truncate`` (True)) blends interpolated and original frequencies by a
linear ramp over the dims (gpt-oss: theta 150000, s 32, L 4096, truncate False):

    corr(r)  = d * ln(L / (2*pi*r)) / (2 * ln(theta))          the dim that turns r times over L
    lo, hi   = corr(beta_fast), corr(beta_slow)                floored / ceiled when truncate,
                                                               clipped to [0, d-1]
    ramp_i   = clamp((i - lo) / (hi - lo), 0, 1)               i = 0..d/2-1
    inv_freq = inv_freq / s * ramp + inv_freq * (1 - ramp)

and scales cos and sin by ``attention_factor`` (default 0.1 * ln(s) + 1): q and k both, so the
scores by its square, which `RotaryEmbedding.score_factor` hands to the attention's softmax
scale instead of rotating scaled vectors.

Angles are computed from the positions at every call (fp32), so no position table bounds the
context and the op has static shapes for CUDA graphs.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

from arfusion.layers.attention import store_kv
from arfusion.layers.head_norm import HeadNorm
from arfusion.layers.kernels.triton_support import triton_available
from arfusion.layers.layernorm import rms_norm_heads


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """``theta ** (-2i / head_dim)`` for i in 0..head_dim/2-1, fp32."""
    if head_dim % 2:
        raise ValueError(f"rotary dim must be even, got {head_dim}")
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def llama3_scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama-3's wavelength-dependent rescaling of ``inv_freq`` (see the module docstring)."""
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    if high <= low:
        raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, blended)
    return torch.where(wavelen < original / high, inv_freq, scaled)


def yarn_scale_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's blend of ``inv_freq`` and ``inv_freq / factor`` (see the module docstring)."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])

    def corr(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = corr(float(scaling.get("beta_fast") or 32)), corr(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    hi = hi + 0.001 if hi == lo else hi
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(rope_scaling: Optional[dict[str, Any]]) -> float:
    """The factor cos and sin are scaled by: YaRN's ``attention_factor`` (default 0.1 * ln(factor)
    + 1, 1 for factor <= 1); 1 for every other type."""
    if not rope_scaling or rope_scaling.get("rope_type", rope_scaling.get("type")) != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = float(rope_scaling["factor"])
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def scaled_inv_freq(head_dim: int, theta: float, rope_scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    """inv_freq for a model's config; ValueError for a scaling type this module does not implement."""
    inv_freq = rope_inv_freq(head_dim, theta)
    if not rope_scaling:
        return inv_freq
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "llama3":
        return llama3_scale_inv_freq(inv_freq, rope_scaling)
    if kind == "yarn":
        return yarn_scale_inv_freq(inv_freq, head_dim, theta, rope_scaling)
    raise ValueError(f"rope scaling type {kind!r} is not supported (supported: default, llama3, yarn)")


class RotaryEmbedding(nn.Module):
    """Applies NeoX-style rotary embedding to the query and key heads."""

    def __init__(self, head_dim: int, rope_theta: float = 10000.0, rope_scaling: Optional[dict[str, Any]] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", scaled_inv_freq(head_dim, rope_theta, rope_scaling).to(device), persistent=False)
        # q.k scales by the square of the factor on cos and sin (YaRN); the attention applies it
        self.score_factor = rope_attention_factor(rope_scaling) ** 2

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``positions[:, None] * inv_freq``: ``[T, head_dim/2]`` each, fp32."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos(), angles.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``q [T, heads*head_dim]``, ``k [T, kv_heads*head_dim]`` -> rotated copies (same
        shapes and dtype); the rotation runs in fp32. On GPU: one Triton kernel
        (layers/kernels/triton_rotary.py, the same roundings); elsewhere `forward_torch`."""
        if q.is_cuda and triton_available():
            from arfusion.layers.kernels.triton_rotary import rotary_embedding

            return rotary_embedding(positions, q, k, self.inv_freq)
        return self.forward_torch(positions, q, k)

    def forward_store_kv(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         head_norm: Optional[HeadNorm] = None) -> torch.Tensor:
        """`forward`, then the new tokens into the KV cache: returns the rotated q (a new tensor)
        and writes, in place, ``k_cache[slot_mapping[t]] = rotated k[t]`` and
        ``v_cache[slot_mapping[t]] = v[t]`` (caches ``[num_slots, kv_heads, head_dim]``). With
        ``head_norm`` every head of q and k (not v) is RMS-normalized first (`layers.head_norm`:
        Qwen3's q_norm/k_norm). On GPU: one Triton kernel for all of it
        (layers/kernels/triton_rotary.py, the same rounding chain); elsewhere
        `layers.layernorm.rms_norm_heads`, `forward`, then `layers.attention.store_kv` (the
        reference)."""
        if q.is_cuda and triton_available():
            from arfusion.layers.kernels.triton_rotary import rotary_embedding_store_kv

            return rotary_embedding_store_kv(positions, q, k, v, self.inv_freq, slot_mapping, k_cache, v_cache,
                                             head_norm=head_norm)
        if head_norm is not None:
            q = rms_norm_heads(q, head_norm.q_weight, head_norm.eps)
            k = rms_norm_heads(k, head_norm.k_weight, head_norm.eps)
        q, k = self.forward(positions, q, k)
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path of `forward` (the reference of the Triton kernel)."""
        cos, sin = self.cos_sin(positions)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        heads = x.view(tokens, -1, self.head_dim).float()
        x1, x2 = heads.chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype).view(tokens, -1)

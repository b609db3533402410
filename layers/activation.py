"""Gated activation of the Llama MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``[..., 2d] -> [..., d]``: ``silu(x[..., :d]) * x[..., d:]`` (gate, then up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul needs an even last dimension, got {x.shape[-1]}")
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

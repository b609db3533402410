"""Gated activation of the Llama MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from arfusion.layers.kernels.triton_support import triton_available


class SiluAndMul(nn.Module):
    """``[..., 2d] -> [..., d]``: ``silu(x[..., :d]) * x[..., d:]`` (gate, then up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On GPU: one Triton kernel (layers/kernels/triton_activation.py, the same roundings);
        elsewhere `forward_torch`."""
        if x.is_cuda and triton_available():
            from arfusion.layers.kernels.triton_activation import silu_and_mul

            return silu_and_mul(x)
        return self.forward_torch(x)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path of `forward` (the reference of the Triton kernel): two kernels."""
        if x.shape[-1] % 2:
            raise ValueError(f"SiluAndMul needs an even last dimension, got {x.shape[-1]}")
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
